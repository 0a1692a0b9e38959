"""`CheckpointStore`: one checkpoint directory as an object, the checkpoint API for any code.

    store = CheckpointStore(ctx.checkpoint_dir, keep_last=3)
    store.save(step, {"model": model.state_dict(), "meta": {"lr": 0.1}})
    latest = store.load_latest()          # the newest committed checkpoint that verifies, or None
    if latest is not None:
        step, state = latest.step, latest.tree   # nested dicts of NumPy arrays and plain values

    store.save_async(step, state)        # blocks only to copy `state` to host memory
    ...                                  # training goes on while it is written and committed
    store.wait()                         # the stats of the save in flight, or its error

State is a nested dict (``hpcdist.store.tree``): tensors and arrays are stored with their
sha256, other values as attributes. The class only binds the module functions of
``hpcdist.store.checkpoints``, ``directory`` and ``discovery`` to a directory and a retention;
``claim`` takes the directory for one writer (``hpcdist.store.claim``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.store import checkpoints, discovery
from hpcdist.store import directory as layout
from hpcdist.store.rawio import snapshot
from hpcdist.store.tree import Tree

if TYPE_CHECKING:
    from hpcdist.store.claim import Claim, Holder


class CheckpointStore:
    """The checkpoints of one directory: save and commit, load (verified), discover and prune."""

    def __init__(self, path: Path | str, *, keep_last: int | None = None) -> None:
        self.directory = Path(path)
        self.keep_last = keep_last
        self._pending: Future[checkpoints.SaveStats] | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._spare: Tree | None = None  # the last snapshot, once written: its arrays are reused

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r}, keep_last={self.keep_last})"

    def path(self, step: int) -> Path:
        """Where the checkpoint of `step` is (or would be) stored."""
        return self.directory / layout.checkpoint_name(step)

    def save(
        self, step: int, state: Mapping[str, Any], *, epoch: int = 0, attrs: Mapping[str, Any] | None = None
    ) -> checkpoints.SaveStats:
        """Write and commit `state` as step `step`, then keep only the newest `keep_last`.

        An asynchronous save in flight is waited for first, and its error, if it failed, is raised
        here (this save is then not started): saves commit in the order they were called, so
        ``latest`` never goes back to an older step.
        """
        self.wait()
        return self._save(step, state, epoch, dict(attrs or {}))

    def _save(self, step: int, state: Mapping[str, Any], epoch: int, attrs: dict[str, Any]) -> checkpoints.SaveStats:
        return checkpoints.save(self.directory, step, state, epoch=epoch, attrs=attrs, keep_last=self.keep_last)

    def save_async(
        self, step: int, state: Mapping[str, Any], *, epoch: int = 0, attrs: Mapping[str, Any] | None = None
    ) -> None:
        """`save`, blocking only while `state` is copied to host memory; the rest runs in a thread.

        The previous asynchronous save is waited for first, and its error, if it failed, is raised
        here (this save is then not started). A crash while the thread writes leaves the previous
        checkpoint the latest: the new file only becomes visible when it is committed. Call
        `wait` before the process ends to learn the outcome of the last one.
        """
        self.wait()
        copied = snapshot(state, self._spare)
        self._spare = None
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcdist-checkpoint")
        self._pending = self._writer.submit(self._write, step, copied, epoch, dict(attrs or {}))

    def _write(self, step: int, state: Tree, epoch: int, attrs: dict[str, Any]) -> checkpoints.SaveStats:
        stats = self._save(step, state, epoch, attrs)  # not `save`: it waits for this very thread
        self._spare = state
        return stats

    def wait(self) -> checkpoints.SaveStats | None:
        """Block until the asynchronous save in flight is committed; its stats (None if there was
        none), or the CheckpointError it failed with (raised once)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    @property
    def saving(self) -> bool:
        """Whether an asynchronous save is in flight."""
        return self._pending is not None and not self._pending.done()

    def load(self, step: int, *, groups: tuple[str, ...] | None = None, verify: bool = True) -> checkpoints.Checkpoint:
        """The checkpoint of `step` (only the named top-level groups, when given), checksums verified."""
        return checkpoints.read(self.path(step), groups=groups, verify=verify)

    def scan(self) -> discovery.Scan:
        """The newest committed checkpoint that verifies, and every file skipped with why."""
        return discovery.scan(self.directory)

    def load_latest(self, report: Callable[[str], None] | None = None) -> checkpoints.Checkpoint | None:
        """The newest committed checkpoint that verifies (read once), or None; skipped files are reported."""
        return discovery.scan(self.directory, keep=True).tell(report).checkpoint

    def latest(self) -> Path | None:
        """The committed checkpoint the ``latest`` pointer names (not verified), or None."""
        return layout.read_pointer(self.directory)[0]

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints present, oldest first."""
        return sorted(layout.step_of(p) or 0 for p in layout.committed_in(self.directory))

    def verify(self, step: int) -> None:
        """Raise a CheckpointError saying why step `step` cannot be trusted."""
        checkpoints.verify(self.path(step))

    def prune(self) -> tuple[Path, ...]:
        """Drop committed checkpoints beyond the newest `keep_last` (none when it is unset)."""
        return layout.prune(self.directory, self.keep_last) if self.keep_last else ()

    def claim(self, holder: Holder | None = None) -> Claim:
        """Claim the directory for one writer (this process by default); a second run fails at
        once naming the holder. Release it with ``Claim.release`` when the run ends."""
        from hpcdist.store.claim import Claim, Holder

        return Claim(self.directory, holder or Holder.this_process()).acquire()

    def remove_temporaries(self) -> list[Path]:
        """Remove files left by killed writers; only when no writer of this directory runs."""
        return layout.remove_temporaries(self.directory)

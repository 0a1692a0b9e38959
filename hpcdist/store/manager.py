"""`CheckpointStore`: one checkpoint directory as an object, the checkpoint API for any code.

    store = CheckpointStore(ctx.checkpoint_dir, keep_last=3)
    store.save(step, {"model": model.state_dict(), "meta": {"lr": 0.1}})
    latest = store.load_latest()          # the newest committed checkpoint that verifies, or None
    if latest is not None:
        step, state = latest.step, latest.tree   # nested dicts of NumPy arrays and plain values

State is a nested dict (``hpcdist.store.tree``): tensors and arrays are stored with their
sha256, other values as attributes. The class only binds the module functions of
``hpcdist.store.checkpoints``, ``directory`` and ``discovery`` to a directory and a retention;
``claim`` takes the directory for one writer (``hpcdist.store.claim``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.store import checkpoints, discovery
from hpcdist.store import directory as layout

if TYPE_CHECKING:
    from hpcdist.store.claim import Claim, Holder


class CheckpointStore:
    """The checkpoints of one directory: save and commit, load (verified), discover and prune."""

    def __init__(self, path: Path | str, *, keep_last: int | None = None) -> None:
        self.directory = Path(path)
        self.keep_last = keep_last

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r}, keep_last={self.keep_last})"

    def path(self, step: int) -> Path:
        """Where the checkpoint of `step` is (or would be) stored."""
        return self.directory / layout.checkpoint_name(step)

    def save(
        self, step: int, state: Mapping[str, Any], *, epoch: int = 0, attrs: Mapping[str, Any] | None = None
    ) -> checkpoints.SaveStats:
        """Write and commit `state` as step `step`, then keep only the newest `keep_last`."""
        return checkpoints.save(self.directory, step, state, epoch=epoch, attrs=attrs, keep_last=self.keep_last)

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

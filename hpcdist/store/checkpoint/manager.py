"""`CheckpointStore`: one checkpoint directory as an object, the checkpoint API for any code.

    store = CheckpointStore(ctx.checkpoint_dir, keep_last=3)
    store.save(step, {"model": model.state_dict(), "meta": {"lr": 0.1}})
    latest = store.load_latest()          # the newest committed checkpoint that verifies, or None
    if latest is not None:
        step, state = latest.step, latest.tree   # nested dicts of NumPy arrays and plain values

    store.save_async(step, state)        # blocks only to copy `state` to host memory
    ...                                  # training goes on while it is written and committed
    store.wait()                         # the stats of the save in flight, or its error

State is a nested dict (``hpcdist.store.checkpoint.tree``): tensors and arrays are stored with their
sha256, other values as attributes.

A store writes for one *run* (``hpcdist.store.checkpoint.directory``): the run of the checkpoint
`load_latest` (or `continue_run`) resumed; else, at the first save, the run of the committed
checkpoint when this same job wrote it (a requeue that does not load), else a new run
(`start_run`), which first moves the files it finds into ``previous/`` and says so in one line.
Its saves, `steps` and pruning see only that run's files. It resumes (`load_latest`, `load`, `scan`)
only from checkpoints no one else could have written, read through the directory held open
(`opened`; ``hpcdist.store.checkpoint.owned``). The class only binds the module functions of
``hpcdist.store.checkpoint.single``, ``directory`` and ``discovery`` to a directory and a retention;
``claim`` takes the directory for one writer (``hpcdist.store.checkpoint.claim``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint import directory as layout
from hpcdist.store.checkpoint import discovery, owned
from hpcdist.store.checkpoint import single as checkpoints
from hpcdist.store.checkpoint.staging import snapshot
from hpcdist.store.checkpoint.tree import Tree, pool

if TYPE_CHECKING:
    from hpcdist.store.checkpoint.claim import Claim, Holder

log = logging.getLogger("hpcdist")


class CheckpointStore:
    """The checkpoints of one directory: save and commit, load (verified), discover and prune."""

    def __init__(self, path: Path | str, *, keep_last: int | None = None, job_id: str | None = None,
                 report: Callable[[str], None] | None = None) -> None:
        """`job_id`: the writer's job (a requeue keeps it; default: Slurm's or submitit's job id
        from the environment); `report`: where the line about files set aside goes (the hpcdist
        log's warnings by default)."""
        self.directory = Path(path)
        self.keep_last = keep_last
        if job_id is None:
            job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or ""
        self.job_id = job_id
        self.report = report or log.warning
        self.run_id: str | None = None  # the run this store writes for, once known
        self._pending: Future[checkpoints.SaveStats] | None = None
        self._spare: Tree | None = None  # the last snapshot, once written: its arrays are reused
        self._claim: Claim | None = None  # this store's claim on the directory: checked before each commit

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
        return self._save(step, state, epoch, dict(attrs or {}), self._run())

    def _save(self, step: int, state: Mapping[str, Any], epoch: int, attrs: dict[str, Any],
              run_id: str) -> checkpoints.SaveStats:
        return checkpoints.save(self.directory, step, state, epoch=epoch, attrs=attrs, keep_last=self.keep_last,
                                **self.commit_identity(run_id))

    def commit_identity(self, run_id: str | None = None) -> dict[str, Any]:
        """What every commit of this store records and checks (``checkpoints.save``'s keywords):
        the run (this store's, `run_id` when known), the writer's job, and the claim's check
        before the rename. A sharded save's coordinator commits with it too."""
        return {"run_id": run_id or self._run(), "job_id": self.job_id,
                "before_commit": self._claim.check if self._claim is not None else None}

    def _run(self) -> str:
        """The run this store writes for: the one it resumed, this job's own, or a new one."""
        if self.run_id is None:
            commit = layout.read_commit(self.directory)
            try:
                run, job = checkpoints.written_by(commit.path) if commit.path else ("", "")
            except Exception:
                run, job = "", ""
            if commit.path is not None and self.job_id and job == self.job_id and run == commit.run:
                self.run_id = run  # a requeue of the job that committed it: the same run
            else:
                self.start_run()
        assert self.run_id is not None
        return self.run_id

    def continue_run(self, run_id: str) -> None:
        """Write for run `run_id` (that of the checkpoint the caller resumed from)."""
        self.run_id = run_id

    def start_run(self, why: str = "") -> str:
        """Begin a new run: the checkpoint files and pointer already here (another run's) move to
        ``previous/`` (kept, never resumed or pruned by this run), said in one line that begins
        with `why`; its id."""
        old = layout.read_commit(self.directory).run
        self.run_id = layout.new_run_id()
        dest, moved = layout.set_aside(self.directory, old)
        if moved:
            steps = [s for s in (layout.step_of(p) for p in moved) if s is not None]
            pointer = f" and their {layout.POINTER}" if any(p.name == layout.POINTER for p in moved) else ""
            self.report(
                f"{why + ': ' if why else ''}new run {self.run_id} in {self.directory}: moved the {len(steps)} "
                f"checkpoint(s) already there (steps {', '.join(map(str, sorted(steps))) or 'none'}"
                f"{f', run {old}' if old else ''}){pointer} to {dest}; they are kept there, "
                f"and this run never resumes or prunes them"
            )
        return self.run_id

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
        run_id = self._run()
        copied = snapshot(state, self._spare)
        self._spare = None
        # the store's one background-save thread (`tree.pool`): a store made per run leaks no thread
        self._pending = pool("checkpoint", 1).submit(self._write, step, copied, epoch, dict(attrs or {}), run_id)

    def _write(self, step: int, state: Tree, epoch: int, attrs: dict[str, Any], run_id: str) -> checkpoints.SaveStats:
        stats = self._save(step, state, epoch, attrs, run_id)  # not `save`: it waits for this very thread
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

    def opened(self) -> AbstractContextManager[Path]:
        """The directory checked and held open (``owned.held``: yours, no one else may write it; a
        CheckpointError naming its owner otherwise): the path to read its files through, whatever
        is renamed meanwhile."""
        return owned.held(self.directory)

    def load(self, step: int, *, groups: tuple[str, ...] | None = None, verify: bool = True,
             mapped: bool = False, within: Path | None = None) -> checkpoints.Checkpoint:
        """The checkpoint of `step` (only the named top-level groups, when given), checksums verified;
        `mapped`: arrays as copy-on-write views of the file (``checkpoints.read``). Read through the
        held directory (`within`, else `opened` here); a file another user could have written is
        refused (``owned``)."""
        if within is None:
            with self.opened() as here:
                return self.load(step, groups=groups, verify=verify, mapped=mapped, within=here)
        path = self.path(step)
        why = owned.step_problem(within / path.name)
        if why is not None:
            raise CheckpointError(f"checkpoint {path}: {why}")
        loaded = checkpoints.read(within / path.name, groups=groups, verify=verify, mapped=mapped)
        loaded.path = path
        return loaded

    def scan(self, within: Path | None = None) -> discovery.Scan:
        """The newest committed checkpoint that verifies, and every file skipped with why (through
        the held directory `within`, when the caller holds it: `opened`)."""
        return discovery.scan(self.directory, within=within)

    def load_latest(self, report: Callable[[str], None] | None = None, *, mapped: bool = False,
                    within: Path | None = None) -> checkpoints.Checkpoint | None:
        """The newest committed checkpoint that verifies (read once; `mapped`: see `load`), or None;
        skipped files are reported. The store then writes for that checkpoint's run (`continue_run`).
        Only this user's own checkpoints are read (``discovery.scan``)."""
        found = discovery.scan(self.directory, keep=True, mapped=mapped, within=within).tell(report)
        if found.checkpoint is not None and found.run_id is not None:
            self.continue_run(found.run_id)
        return found.checkpoint

    def latest(self) -> Path | None:
        """The committed checkpoint the ``latest`` pointer names (not verified), or None."""
        return layout.read_pointer(self.directory)[0]

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints present (of the pointer's run), oldest first."""
        return sorted(layout.step_of(p) or 0 for p in layout.committed_in(self.directory, checkpoints.run_of))

    def verify(self, step: int) -> None:
        """Raise a CheckpointError saying why step `step` cannot be trusted."""
        checkpoints.verify(self.path(step))

    def prune(self) -> tuple[Path, ...]:
        """Drop committed checkpoints beyond the newest `keep_last` (none when it is unset)."""
        return layout.prune(self.directory, self.keep_last, checkpoints.run_of) if self.keep_last else ()

    def claim(self, holder: Holder | None = None) -> Claim:
        """Claim the directory for one writer (this process by default); a second run fails at
        once naming the holder; every later commit checks the claim is still this one. Release it
        with ``Claim.release`` when the run ends."""
        from hpcdist.store.checkpoint.claim import Claim, Holder

        self._claim = Claim(self.directory, holder or Holder.this_process()).acquire()
        return self._claim

    def remove_temporaries(self) -> list[Path]:
        """Remove files left by killed writers; only when no writer of this directory runs."""
        return layout.remove_temporaries(self.directory)

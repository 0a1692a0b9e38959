"""One writer per directory: a run claims the directory it writes checkpoints into.

The claim is a lock file made with ``O_CREAT | O_EXCL`` (atomic on NFS v3+ and Lustre, where
flock is not dependable) holding the holder's job id, job step, restart count, host, pid and
start time. A second run fails at once naming the holder and what to do.

A claim is taken from its holder only when the holder is proven gone, or by a later start of
the very same job step:

- a requeue (the same job and step, a higher restart count: Slurm's, or the local controller's)
  takes its own claim back; so does a later in-job restart of a job with spare nodes (the same
  job and requeue, a new step with a higher ``in_job`` count: ``hpcdist.runtime.in_job``, whose
  supervisor killed the step it replaces); another step of the same allocation (a second
  ``srun``) does not, while that step runs;
- Slurm saying the holder's job ended (squeue does not list it and sacct has its end state),
  or, on this host, the holder's process being gone, makes a claim stale;
- anything else is *unknown*, never dead: squeue answering nothing for a job sacct does not know
  either (another user's job under ``PrivateData``, another cluster's id), a Slurm command that
  fails, a claim file that cannot be read (EACCES, ESTALE). The claim is refused with a message
  that says what to check.

Taking over is atomic: the stale file is renamed to a name of the taker's own and its content
compared with what was judged stale; a file that changed in between (another taker's new
claim) is put back. ``check`` lets the holder re-read its claim before each commit.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint import owned

CLAIM_NAME = ".claim"


@dataclass(frozen=True)
class Holder:
    """Who holds (or wants) a claim."""

    job_id: str
    host: str
    pid: int
    started: float
    step: str = ""  # Slurm's job step (SLURM_STEP_ID), "" outside a step
    restarts: int = 0  # how often the job was requeued (Slurm's restart count, or the local controller's)
    in_job: int = 0  # how often a job with spare nodes started its ranks again in its allocation (a new step)

    @classmethod
    def this_process(cls, env: Mapping[str, str] | None = None) -> Holder:
        """This process as a holder: its Slurm job id, else ``local-<id>`` (submitit's local job
        id, which a local requeue keeps, or the pid)."""
        from hpcdist.config.contract import in_job_restarts, restart_count

        env = os.environ if env is None else env
        job = env.get("SLURM_JOB_ID") or f"local-{env.get('SUBMITIT_LOCAL_JOB_ID') or os.getpid()}"
        step = env.get("SLURM_STEP_ID", "") if env.get("SLURM_JOB_ID") else ""
        return cls(job, socket.gethostname(), os.getpid(), time.time(), step, restart_count(env),
                   in_job_restarts(env))

    @property
    def slurm_job(self) -> bool:
        from hpcdist.scheduler.slurm import is_job_id

        return is_job_id(self.job_id)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        step = f" step {self.step}" if self.step else ""
        again = f", restart {self.restarts}" if self.restarts else ""
        return f"job {self.job_id}{step} on {self.host} (pid {self.pid}{again}, since {when})"


def _process_gone(holder: Holder) -> bool | None:
    """On this host: whether the holder's process is gone; None on another host."""
    if holder.host != socket.gethostname():
        return None
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def verdict(current: Holder, me: Holder) -> tuple[bool, str]:
    """(may `me` take `current`'s claim, why not / why); see the module's docstring."""
    from hpcdist.scheduler import slurm

    if current.job_id == me.job_id and current.step == me.step:
        if me.restarts > current.restarts:
            return True, "a requeue of the same job takes its own claim back"
        if _process_gone(current):
            return True, "the holder's process is gone"
        return False, "is still running (the same job step started twice?)"
    gone = _process_gone(current)
    if current.slurm_job:
        if current.job_id == me.job_id and me.restarts == current.restarts and me.in_job > current.in_job:
            return True, "an in-job restart takes the claim of the step it replaced"
        if current.job_id == me.job_id:  # another step of this allocation
            steps = slurm.job_steps(current.job_id)
            if steps is None:
                return False, "cannot be checked from here (squeue failed)"
            if current.step in steps:
                return False, "is still running"
            return True, f"its step {current.step} ended"
        reading = slurm.read_state(current.job_id)
        if reading.state.final:
            return True, f"Slurm says it ended ({reading.state.value})"
        if reading.state.may_write:
            return False, f"is still {reading.state.value.lower()}"
        if gone:
            return True, "the holder's process is gone"
        why = ("Slurm lists no such job and has no record of its end (another user's job, or another cluster's)"
               if reading.absent else "Slurm could not be asked")
        return False, f"cannot be checked from here: {why}"
    if gone is None:
        return False, f"cannot be checked from here (it ran on {current.host})"
    return (True, "the holder's process is gone") if gone else (False, "is still running")


class Claim:
    """The claim on `directory` held by `holder` (``acquire`` makes it, ``release`` drops it)."""

    def __init__(self, directory: Path | str, holder: Holder) -> None:
        self.directory = Path(directory)
        self.holder = holder
        self.path = self.directory / CLAIM_NAME
        self.took_over: Holder | None = None  # the stale holder this claim replaced, if any

    def __repr__(self) -> str:
        return f"Claim({str(self.directory)!r}, {self.holder.describe()})"

    def acquire(self) -> Claim:
        """Claim the directory, or raise a CheckpointError naming the holder and what to do (or,
        for a folder another user could have written, whose it is: ``owned.held``)."""
        owned.make_folder(self.directory)
        owned.check_folder(self.directory)  # a run writes into, and resumes from, a folder of its own only
        for _ in range(5):  # a takeover races with another taker at most a few times
            if self._create():
                return self
            raw = _read_raw(self.path)
            if raw is None:
                continue  # released between the two calls
            current = _parse(raw, self.path)
            if current is None:  # being written (O_EXCL made it empty) or damaged
                if time.time() - _mtime(self.path) < 10:
                    time.sleep(0.2)
                    continue
                self._take(raw)
                continue
            take, why = verdict(current, self.holder)
            if not take:
                how = "wait for it to end" + (f" or `scancel {current.job_id}`" if current.slurm_job else "")
                raise CheckpointError(
                    f"checkpoint directory {self.directory} is claimed by {current.describe()}, which {why}: "
                    f"two runs would overwrite and prune each other's checkpoints; {how}, give this run another "
                    f"job name or checkpoint directory, or remove {self.path} if that job is surely gone"
                )
            own = (current.job_id, current.step) == (self.holder.job_id, self.holder.step)
            if self._take(raw) and not own:  # a requeue taking its own claim back takes over nobody
                self.took_over = current
        raise CheckpointError(f"could not claim {self.directory}: the claim file kept changing; try again")

    def check(self) -> None:
        """Raise a CheckpointError unless the claim is still this holder's (before a commit)."""
        raw = _read_raw(self.path)
        current = _parse(raw, self.path) if raw is not None else None
        if current != self.holder:
            who = current.describe() if current else "nobody (the claim file is gone)"
            raise CheckpointError(
                f"the claim on {self.directory} is no longer this run's ({self.holder.describe()}): it is held by "
                f"{who}; nothing more is committed by this run, whose last committed checkpoint stays; make sure "
                f"one run writes this directory"
            )

    def release(self) -> None:
        """Drop the claim if it is still ours (a takeover by someone else is left alone)."""
        raw = _read_raw(self.path)
        if raw is not None and _parse(raw, self.path) == self.holder:
            self._take(raw)

    def __enter__(self) -> Claim:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(asdict(self.holder)))
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def _take(self, judged: str) -> bool:
        """Remove the claim file if it still holds `judged`, atomically: renamed to a name of our
        own first, so of two takers only one gets it; a file that changed since it was judged
        is put back. Whether it was removed."""
        aside = self.path.with_name(f"{CLAIM_NAME}.taken-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if _read_raw(aside) != judged:
            try:
                os.link(aside, self.path)  # put back, unless a new claim is there already
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True


def _read_raw(path: Path) -> str | None:
    """The claim file's text; None when there is none. A file that cannot be read is an error:
    unknown is not unclaimed."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(
            f"cannot read the checkpoint claim {path} ({type(exc).__name__}: {exc}); another user's run may hold "
            f"the directory, or the shared file system is failing: check the file's owner and permissions and "
            f"that the file system is mounted, then try again"
        ) from exc


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _parse(raw: str, path: Path) -> Holder | None:
    try:
        data = json.loads(raw)
        return Holder(str(data["job_id"]), str(data["host"]), int(data["pid"]), float(data["started"]),
                      str(data.get("step", "")), int(data.get("restarts", 0)), int(data.get("in_job", 0)))
    except (ValueError, KeyError, TypeError):
        return None


def read(directory: Path | str) -> Holder | None:
    """The holder of `directory`'s claim, or None when it is unclaimed (or the file is damaged)."""
    path = Path(directory) / CLAIM_NAME
    raw = _read_raw(path)
    return _parse(raw, path) if raw is not None else None

"""One writer per directory: a run claims the directory it writes checkpoints into.

The claim is a lock file made with ``O_CREAT | O_EXCL`` (atomic on NFS v3+ and Lustre, where
flock is not dependable) holding the holder's job id, host, pid and start time. A second run
fails at once naming the holder and what to do. A claim is *stale*, and taken over, once Slurm
says the holder's job has ended (``squeue`` no longer lists it), or, for a job without a Slurm
id on this same host, once its process is gone. A requeue of the same job (same job id) takes
its own claim back. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcdist.errors import CheckpointError

CLAIM_NAME = ".claim"
# squeue states of a job that may still write (a requeued job comes back as PENDING).
_ALIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "STOPPED",
          "SIGNALING", "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD")


@dataclass(frozen=True)
class Holder:
    """Who holds (or wants) a claim."""

    job_id: str
    host: str
    pid: int
    started: float

    @classmethod
    def this_process(cls, env: Mapping[str, str] | None = None) -> Holder:
        """This process as a holder: its Slurm job id, else ``local-<id>`` (submitit's local job
        id, which a local requeue keeps, or the pid)."""
        env = os.environ if env is None else env
        job = env.get("SLURM_JOB_ID") or f"local-{env.get('SUBMITIT_LOCAL_JOB_ID') or os.getpid()}"
        return cls(job, socket.gethostname(), os.getpid(), time.time())

    @property
    def slurm_job(self) -> bool:
        return bool(re.fullmatch(r"\d+(_\d+)?", self.job_id))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"job {self.job_id} on {self.host} (pid {self.pid}, since {when})"


def holder_alive(holder: Holder) -> bool | None:
    """Whether the holder may still write: Slurm's word for a Slurm job id, the process table for
    a local job on this host; None when neither can tell (another host, no Slurm)."""
    if holder.slurm_job and shutil.which("squeue"):
        proc = subprocess.run(["squeue", "-h", "-j", holder.job_id, "-o", "%T"],
                              capture_output=True, text=True, check=False, timeout=30)
        if proc.returncode == 0:
            return any(s.startswith(_ALIVE) for s in proc.stdout.split())
        if "Invalid job id" in proc.stderr:
            return False  # Slurm has forgotten the job: it ended long ago
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return None


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
        """Claim the directory, or raise a CheckpointError naming the holder and what to do."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a takeover races with another taker at most a couple of times
            if self._create():
                return self
            current = read(self.directory)
            if current is None:
                continue  # released (or half-written and removed) between the two calls
            if current.pid == -1:
                time.sleep(0.2)  # another taker is writing its claim right now
                continue
            if current.job_id == self.holder.job_id:
                self._write_over()  # a requeue of the same job takes its own claim back
                return self
            alive = holder_alive(current)
            if alive is False:
                self.took_over = current
                self.path.unlink(missing_ok=True)
                continue
            how = "wait for it to end" + (f" or `scancel {current.job_id}`" if current.slurm_job else "")
            state = "is still running" if alive else "cannot be checked from here"
            raise CheckpointError(
                f"checkpoint directory {self.directory} is claimed by {current.describe()}, which {state}: "
                f"two runs would overwrite and prune each other's checkpoints; {how}, give this run another "
                f"job name or checkpoint directory, or remove {self.path} if that job is surely gone"
            )
        raise CheckpointError(f"could not claim {self.directory}: the claim file kept changing; try again")

    def release(self) -> None:
        """Drop the claim if it is still ours (a takeover by someone else is left alone)."""
        current = read(self.directory)
        if current is not None and (current.job_id, current.pid) == (self.holder.job_id, self.holder.pid):
            self.path.unlink(missing_ok=True)

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

    def _write_over(self) -> None:
        tmp = self.path.with_name(f"{CLAIM_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self.holder)))
        os.replace(tmp, self.path)


def read(directory: Path | str) -> Holder | None:
    """The holder of `directory`'s claim, or None when it is unclaimed."""
    path = Path(directory) / CLAIM_NAME
    try:
        data = json.loads(path.read_text())
        return Holder(str(data["job_id"]), str(data["host"]), int(data["pid"]), float(data["started"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # Being written right now (O_EXCL made it empty) or damaged: treat an old one as stale.
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        if age < 10:
            return Holder("(being written)", "?", -1, time.time())
        path.unlink(missing_ok=True)
        return None

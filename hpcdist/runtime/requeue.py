"""Stop signals, the requeue count and its bound, and requeueing through submitit or Slurm.

Signals. A job is told to stop by the site's preemption signal (``--signal=SIG@N``; Slurm sends
it before a time limit, and before a preemption only where the site set
``PreemptParameters=send_user_signal``) or by SIGTERM, which Slurm always sends when it preempts,
requeues or cancels a job, ``KillWait`` seconds before SIGKILL. submitit's runner installs its own
handlers: one that requeues at once on the preemption signal (before any checkpoint) and one that
ignores ("bypasses") SIGTERM. ``watch`` replaces both, as early as the rank starts, with one flag
(which signal came first); ``hpcdist.api.Context.should_stop`` reads it, the ranks agree at a step
boundary, checkpoint, and only then requeue.

Requeueing. ``requeue_for`` asks submitit's job environment (``scontrol requeue <job id>`` on
Slurm, exit code 144 on the local site, whose controller restarts the ranks) or plain
``scontrol requeue`` outside submitit; on Slurm it first asks Slurm about the job: after SIGTERM
the job may already be requeued by Slurm itself (preemption, ``scontrol requeue``), or be ending
for good (``scancel``, a time limit), where ``scontrol requeue`` would bring a cancelled job back.
A requeued job has written no result, so it is never taken as finished.

In a container. The ranks of a job in a container (``hpcdist.containers``) run in an image that
rarely has Slurm's commands or munge's socket (pyxis' issue 31, Lightning's requeue inside pyxis),
so they ask the batch step, which runs outside: every rank's requeue writes
``<folder>/<job id>_requeue.request`` and ends as a requeued rank does; the job script's exit
runs ``python -m hpcdist.runtime.requeue FOLDER`` with the node's Python, which makes the same
decision (``slurm_leaves_it``) and requeues.

The bound. ``preemption.max_requeues`` bounds the time-outs of one job; preemptions are the
site's doing and are not bounded. The count survives a restart in the checkpoint, and has Slurm's
own count (``SLURM_RESTART_COUNT``) as a floor, so a run that starts afresh (``resume: false``,
``if_unusable: start_fresh``) cannot be requeued forever: a restart not on record counts as a
time-out.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Literal

from hpcdist.config.contract import array_task_id, restart_count
from hpcdist.containers import CONTAINER_VAR
from hpcdist.files.atomic import atomic_path
from hpcdist.scheduler import slurm
from hpcdist.scheduler.states import JobState

log = logging.getLogger("hpcdist")

# How close to the time limit a preemption signal must come to count as a time-out: Slurm sends
# `--signal=SIG@N` up to a minute late, and a rank needs a moment to notice.
TIMEOUT_SLACK_S = 60.0

StopKind = Literal["timeout", "preemption"]


class Requeued(SystemExit):
    """Raised on every rank once the job is requeued: the process ends without a result."""


def classify(now: float, launch_time: float, limit_s: float, seconds_before_end: float) -> StopKind:
    """``timeout`` if the signal came within the warning time of the job's limit, else ``preemption``."""
    left = launch_time + limit_s - now
    return "timeout" if left <= seconds_before_end + TIMEOUT_SLACK_S else "preemption"


# ---------------------------------------------------------------- the stop flag

_received: list[int] = []  # signal numbers in the order they came; the process's one flag


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)  # only a flag: the ranks agree at a step boundary


def watch(names: Iterable[str]) -> list[str]:
    """Handle the named signals (``USR2``, ``TERM``) with the stop flag, replacing submitit's
    handlers; the names that could not be handled (not the main thread) are returned."""
    failed = []
    for name in dict.fromkeys(names):
        try:
            signal.signal(getattr(signal, f"SIG{name}"), _on_signal)
        except ValueError:  # not the main thread: the launcher's handler stays
            failed.append(name)
    return failed


def received() -> int:
    """The number of the first stop signal this process received, 0 if none."""
    return _received[0] if _received else 0


def signal_name(signum: int) -> str:
    """``TERM`` for 15: the name the site config and the logs use."""
    return signal.Signals(signum).name.removeprefix("SIG") if signum else ""


# ---------------------------------------------------------------- the count and its bound


@dataclass(frozen=True)
class Requeues:
    """How often this job was requeued so far, and how many of those were time-outs."""

    requeues: int = 0
    timeouts: int = 0

    def at_least(self, restarts: int, node_failures: int = 0) -> Requeues:
        """Slurm's own count as a floor: restarts not on record (a fresh start lost the record)
        count as time-outs, so losing the record never lifts the bound; the `node_failures`
        restarts (the job's node failure record: Slurm requeued it after a node died) are not
        time-outs, and bounded on their own (``hpcdist.runtime.node_failure``)."""
        missing = max(0, restarts - node_failures - self.requeues)
        return Requeues(self.requeues + missing, self.timeouts + missing)

    def after(self, kind: StopKind) -> Requeues:
        return Requeues(self.requeues + 1, self.timeouts + (kind == "timeout"))

    def over(self, max_requeues: int) -> bool:
        return self.timeouts > max_requeues


# ---------------------------------------------------------------- requeueing


def slurm_leaves_it(job_id: str, restarts: int) -> str:
    """Why hpcdist must not requeue Slurm job `job_id` itself ("" when it must): Slurm already
    requeued it (its restart count passed ours: a preemption or ``scontrol requeue``), or it is
    ending for good (``scancel``, a time limit), which a requeue would undo."""
    known = slurm.show_job(job_id)
    if known is None:
        return ""
    if known.restarts > restarts or known.state in (JobState.PENDING, JobState.REQUEUED):
        return f"Slurm is requeueing job {job_id} itself ({known.word}, restart {known.restarts})"
    if known.state not in (JobState.RUNNING, JobState.SUSPENDED):
        return f"job {job_id} is ending in Slurm ({known.word}): not requeued; resubmit the same spec to resume"
    return ""


def record_requeue(path: Path, run: int, how: str) -> None:
    """Note in the job's folder that run `run` (1: the first) asked for its requeue: what the
    requeued run's node failure check trusts where Slurm's accounting cannot be read. Best effort."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # never through a link
        with os.fdopen(fd, "a") as f:
            f.write(f"run {run} requeued: {how} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    except OSError as exc:
        log.warning("could not note the requeue in %s: %s", path, exc)


def requeued_runs(path: Path) -> set[int]:
    """The runs noted by `record_requeue` (none when the file is not there or cannot be read, or
    when another user could have written it: ``hpcdist.files.trust``, said in a warning)."""
    from hpcdist.files.trust import UntrustedFileError, read_trusted

    try:
        text = read_trusted(path, limit=1 << 20).decode(errors="replace")
    except UntrustedFileError as exc:
        log.warning("ignoring the job's requeue record: %s", exc.why)
        return set()
    except OSError:
        return set()
    return {int(m.group(1)) for m in re.finditer(r"^run (\d+) requeued", text, re.MULTILINE)}


def requeue_for(env: Mapping[str, str], record: Path | None = None) -> Callable[[], str] | None:
    """The requeue of a launch, as `env` says it was started (submitit's Slurm or local
    executor, or a plain Slurm job), or None when nothing can requeue it. The returned function
    requeues, or returns why it did not (Slurm requeues or ends the job itself); first it notes
    the requeue in `record` (``JobPaths.requeues``): this run stopped for a signal, not a node death."""
    executor = env.get("SUBMITIT_EXECUTOR", "")
    slurm_job = env.get("SLURM_JOB_ID", "")
    restarts = restart_count(env)
    if executor not in ("slurm", "local") and not slurm_job:
        return None

    def requeue() -> str:
        if record is not None:
            record_requeue(record, restarts + 1, "asked by the job")
        if executor == "slurm" and env.get(CONTAINER_VAR):
            from submitit.core.job_environment import JobEnvironment

            job = JobEnvironment()
            ask_outside(Path(job.paths.folder), job.job_id, restarts)
            return ""
        if executor != "local" and slurm_job:
            why = slurm_leaves_it(slurm_job, restarts)
            if why:
                return why
        for handler in logging.getLogger("hpcdist").handlers:
            handler.flush()
        if executor == "local":
            from submitit.core.job_environment import JobEnvironment

            job = JobEnvironment()
            log.warning("requeueing job %s through submitit (%s)", job.job_id, executor)
            job._requeue(0)  # sys.exit(144): the local controller restarts the ranks
        elif executor == "slurm":
            from submitit.core.job_environment import JobEnvironment

            job_id = JobEnvironment().job_id  # ARRAYID_INDEX for an array task, as submitit requeues it
            log.warning("requeueing job %s (slurm) through the scheduler client", job_id)
            slurm.requeue(job_id)
        else:
            log.warning("requeueing Slurm job %s", slurm_job)
            slurm.requeue(slurm_job)
        return ""

    return requeue


# ---------------------------------------------------------------- asked from inside a container


def request_path(folder: Path, job_id: str) -> Path:
    """Where a rank in a container asks the batch step to requeue job `job_id`."""
    return folder / f"{job_id}_requeue.request"


def ask_outside(folder: Path, job_id: str, restarts: int) -> None:
    """A rank's requeue, from inside a container: the request the batch step carries out when the
    launch has ended (every rank writes the same text; the last rename wins)."""
    with atomic_path(request_path(folder, job_id)) as tmp:
        tmp.write_text(f"{restarts}\n")
    log.warning("asked the job script to requeue job %s (the ranks run in a container)", job_id)


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """``python -m hpcdist.runtime.requeue FOLDER``: the job script's last step for ranks in a
    container; requeues the job when they asked for it. Says what it did on the batch output."""
    env = os.environ if env is None else env
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcdist.runtime.requeue FOLDER", file=sys.stderr)
        return 2
    job_id = array_task_id(env) or env.get("SLURM_JOB_ID", "")
    path = request_path(Path(args[0].replace("%j", job_id)), job_id)
    try:
        restarts = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not asked
    path.unlink(missing_ok=True)
    why = slurm_leaves_it(job_id, restarts)
    if why:
        print(f"hpcdist: the ranks asked for a requeue: {why}", file=sys.stderr, flush=True)
        return 0
    print(f"hpcdist: requeueing job {job_id}, as its ranks in the container asked", file=sys.stderr, flush=True)
    slurm.requeue(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())

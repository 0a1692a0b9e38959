"""Submission through submitit, which keeps the job's lifecycle (state, results, requeue).

On a Slurm site submitit submits hpcdist's rendered script (not its own): ``ScriptExecutor``
overrides the one method that makes the script text, so ``hpcdist render`` shows byte for
byte what is submitted. On the local site submitit's LocalExecutor runs the ranks as processes.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import SubmitError
from hpcdist.polling import poll_until
from hpcdist.postmortem import Ending, accounting, ending
from hpcdist.render import Origin, render, submitit_folder


@functools.cache
def _script_executor_class() -> Callable[[Path, str, int, int], Any]:
    """submitit's Slurm executor with the submission script replaced by hpcdist's (made on first
    use: submitit is imported only when something is submitted)."""
    import submitit

    class ScriptExecutor(submitit.SlurmExecutor):
        def __init__(self, folder: Path, script: str, num_tasks: int, max_num_timeout: int) -> None:
            super().__init__(folder, max_num_timeout=max_num_timeout)
            self._script = script
            self._tasks = num_tasks

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return self._script

        def _num_tasks(self) -> int:
            return self._tasks

    return ScriptExecutor


@dataclass
class Submission:
    job: Any  # submitit.Job
    spec: JobSpec
    site: Site
    script: str

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def log_paths(self) -> tuple[Path, Path]:
        return self.job.paths.stdout, self.job.paths.stderr

    @property
    def result_path(self) -> Path:
        return self.spec.result_path(self.site, self.job_id)


@dataclass
class TaskOutcome:
    rank: int
    ok: bool
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def _tasks(spec: JobSpec) -> int:
    return spec.resources.world_size


def submit(spec: JobSpec, site: Site, origin: Origin) -> Submission:
    """Submit `spec` to `site`; returns as soon as the scheduler has the job."""
    import submitit
    from submitit.core.utils import FailedJobError

    from hpcdist.runtime.entry import run_rank  # the callable only; nothing runs here

    script = render(spec, site, origin)
    folder = submitit_folder(spec, site)
    if site.scheduler == "slurm":
        if shutil.which("sbatch") is None:
            raise SubmitError(f"site {site.name!r} uses Slurm but `sbatch` is not on PATH; run on a login node")
        executor: Any = _script_executor_class()(folder, script, _tasks(spec), site.preemption.max_requeues)
        executor.update_parameters(
            time=spec.time_limit_min(site),
            nodes=spec.resources.nodes,
            ntasks_per_node=spec.resources.tasks_per_node,
        )
    else:
        executor = submitit.LocalExecutor(folder)
        executor.update_parameters(
            timeout_min=spec.time_limit_min(site),
            nodes=1,
            tasks_per_node=spec.resources.tasks_per_node,
        )
        os.environ[LAUNCH_TIME_VAR] = repr(time.time())
    try:
        job = executor.submit(run_rank, spec, site)
    except FailedJobError as exc:
        raise SubmitError(f"the scheduler refused job {spec.name!r}: {_first_error_line(str(exc))}") from exc
    except OSError as exc:
        raise SubmitError(f"could not submit job {spec.name!r}: {exc}") from exc
    return Submission(job=job, spec=spec, site=site, script=script)


class JobState(Enum):
    """A job's state as hpcdist reasons about it, mapped once from the scheduler's strings
    (TorchX's ``SLURM_STATES -> AppState``); ``final`` states never change again."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    REQUEUED = "REQUEUED"  # back in the queue after a preemption or a time-out
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    UNKNOWN = "UNKNOWN"  # the scheduler does not (yet) know the job, or said something else

    @property
    def final(self) -> bool:
        return self in _FINAL_STATES

    @classmethod
    def from_slurm(cls, text: str) -> JobState:
        """sacct's or squeue's word (``CANCELLED by 0``, ``CA``, ``COMPLETING``) as a JobState."""
        word = text.strip().split(" ")[0].rstrip("+").upper()
        return _SLURM_STATES.get(word, cls.UNKNOWN)

    @classmethod
    def from_submitit_local(cls, text: str) -> JobState:
        """submitit's LocalJob states (FINISHED, INTERRUPTED, ...) as a JobState."""
        return _LOCAL_STATES.get(text.strip().upper(), cls.UNKNOWN)


_FINAL_STATES = frozenset({
    JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED, JobState.OUT_OF_MEMORY,
    JobState.NODE_FAIL, JobState.PREEMPTED, JobState.BOOT_FAIL, JobState.DEADLINE,
})
# Slurm's long names (sacct, squeue %T) and short codes (squeue %t) for every state it reports.
_SLURM_STATES: dict[str, JobState] = {
    **{s.value: s for s in JobState if s is not JobState.UNKNOWN},
    "PD": JobState.PENDING, "CF": JobState.PENDING, "CONFIGURING": JobState.PENDING,
    "R": JobState.RUNNING, "RESIZING": JobState.RUNNING, "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.COMPLETING, "CG": JobState.COMPLETING, "SO": JobState.COMPLETING,
    "RQ": JobState.REQUEUED, "REQUEUE_FED": JobState.REQUEUED, "REQUEUE_HOLD": JobState.REQUEUED,
    "RS": JobState.PENDING, "RESV_DEL_HOLD": JobState.PENDING, "RV": JobState.PENDING, "REVOKED": JobState.CANCELLED,
    "S": JobState.SUSPENDED, "ST": JobState.SUSPENDED, "STOPPED": JobState.SUSPENDED, "RH": JobState.REQUEUED,
    "CD": JobState.COMPLETED, "F": JobState.FAILED, "TO": JobState.TIMEOUT, "CA": JobState.CANCELLED,
    "OOM": JobState.OUT_OF_MEMORY, "NF": JobState.NODE_FAIL, "PR": JobState.PREEMPTED, "BF": JobState.BOOT_FAIL,
    "DL": JobState.DEADLINE, "SE": JobState.FAILED, "SPECIAL_EXIT": JobState.FAILED,
}
_LOCAL_STATES = {
    "RUNNING": JobState.RUNNING, "FINISHED": JobState.COMPLETED, "DONE": JobState.COMPLETED,
    "FAILED": JobState.FAILED, "INTERRUPTED": JobState.CANCELLED, "UNKNOWN": JobState.UNKNOWN,
}


@dataclass(frozen=True)
class Finished:
    """What ``wait`` learnt: the scheduler's final state and one outcome per rank."""

    state: JobState
    outcomes: list[TaskOutcome]
    cause: str = ""  # which rank and host went first and how, and Slurm's cause (cancelled, ...)

    @property
    def ok(self) -> bool:
        """Success means both: the scheduler says COMPLETED and every rank returned a result."""
        return self.state is JobState.COMPLETED and all(o.ok for o in self.outcomes)


def job_state(sub: Submission) -> JobState:
    """The scheduler's current word on the job (Slurm: sacct, else squeue; local: submitit)."""
    if sub.site.scheduler == "slurm":
        return slurm_state(sub.job_id)
    return JobState.from_submitit_local(str(sub.job.state))


def wait(sub: Submission, poll_s: float = 1.0, timeout_s: float | None = None) -> Finished:
    """Block until the scheduler says the job ended; its final state and one outcome per rank.

    Waiting ends on the scheduler's word (Slurm's accounting, or squeue), not on submitit's
    result files, which a job that dies early never writes. A rank without a result is
    summarised by how srun saw it end (killed by a signal, its exit code) or else the first real
    error line of its log; a failed job's ``cause`` names the rank and host that went first and
    Slurm's word on the job (cancelled, node failure, out of memory; ``hpcdist.postmortem``).
    ``timeout_s=None`` waits as long as the scheduler says the job is not done.
    """
    from submitit.core.utils import FailedJobError, UncompletedJobError

    def ended() -> JobState | None:
        state = job_state(sub)
        if state.final:
            return state
        if sub.site.scheduler != "slurm" and sub.job.done(force_check=True):
            return JobState.COMPLETED if state is JobState.UNKNOWN else state
        return None

    state = poll_until(ended, timeout_s, poll_s)
    if state is None:
        raise SubmitError(
            f"job {sub.job_id} did not finish within {timeout_s:g} s; it is still {job_state(sub).value}"
        )
    end = _slurm_ending(sub) if sub.site.scheduler == "slurm" and state is not JobState.COMPLETED else None
    outcomes = []
    for rank in range(_tasks(sub.spec)):
        task = sub.job.task(rank)
        if not task.paths.result_pickle.exists():
            outcomes.append(TaskOutcome(rank, False, error=_no_result(task.paths.stderr, state, rank, end)))
            continue
        try:
            outcomes.append(TaskOutcome(rank, True, summary=dict(task.result() or {})))
        except (FailedJobError, UncompletedJobError) as exc:
            after = f" ({end.after(rank)})" if end and end.after(rank) else ""
            outcomes.append(TaskOutcome(rank, False, error=_first_error_line(str(exc)) + after))
    if sub.site.scheduler != "slurm" and state is JobState.COMPLETED and not all(o.ok for o in outcomes):
        state = JobState.FAILED  # submitit's local controller says FINISHED whatever its ranks did
    return Finished(state, outcomes, end.headline() if end else "")


def _slurm_ending(sub: Submission) -> Ending:
    """srun's and slurmstepd's lines in the batch log, and Slurm's accounting of the job's steps."""
    try:
        batch_log = sub.log_paths[1].read_text(errors="replace")
    except OSError:
        batch_log = ""
    return ending(batch_log, accounting(sub.job_id))


def _no_result(path: Path, state: JobState, rank: int, end: Ending | None) -> str:
    """Why a rank left no result: how srun saw it end, or the job's cause, or its log's first error."""
    task = end.tasks.get(rank) if end else None
    if end is not None and task is not None:
        first = "the first rank to end" if end.first == task else end.after(rank)
        if task.how.startswith("exited"):  # its own log says why: keep that, add srun's word
            return f"{_log_error(path, state)} ({task.how} on {task.host}, {first})"
        return f"{task.how} on {task.host} ({first}); no result"
    if end is not None and end.cause:
        return f"no result; the job ended: {end.cause}"
    return _log_error(path, state)


def _log_error(path: Path, state: JobState) -> str:
    """The first real error line of a rank's log, or why there is none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"no result and no log ({path}); the job ended {state.value} before this rank started"
    line = _first_error_line(text, first=True)
    return f"no result; {line}" if line != "(no output)" else f"no result and an empty log ({path})"


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")
_SLURM_LINE = re.compile(r"^(?:srun|slurmstepd|mpirun|torchrun)[^:]*: (?:error|error:)?\s*(.+)$", re.IGNORECASE)
_NOT_THE_CAUSE = {"FailedJobError", "UncompletedJobError", "ChildFailedError"}


def _first_error_line(text: str, first: bool = False) -> str:
    """The last `SomeError: message` line of a traceback (the first one in a log, `first`), else
    the first line srun or slurmstepd wrote as an error, else the text's last line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for line in (lines if first else reversed(lines)):
        match = _ERROR_LINE.match(line)
        if match and match.group(1) not in _NOT_THE_CAUSE:
            return f"{match.group(1)}: {match.group(2)}"
    for line in lines:
        if _SLURM_LINE.match(line) and "error" in line.lower():
            return line.strip()
    return lines[-1].strip() if lines else "(no output)"


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    name: str
    state: str
    exit_code: str
    elapsed: str
    nodes: str


def status(job_id: str) -> list[JobStatus]:
    """The job's state from Slurm's accounting (one row per requeue-visible record)."""
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise SubmitError(f"job id {job_id!r} is not a Slurm job id (digits, e.g. 1234)")
    if shutil.which("sacct") is None:
        raise SubmitError("`sacct` is not on PATH; `hpcdist status` needs Slurm's accounting")
    proc = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-P", "-n", "-o", "JobID,JobName,State,ExitCode,Elapsed,NodeList"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SubmitError(f"sacct failed for job {job_id}: {proc.stderr.strip()}")
    rows = [JobStatus(*line.split("|")[:6]) for line in proc.stdout.splitlines() if line.strip()]
    if not rows:
        raise SubmitError(f"Slurm knows no job {job_id}; check the id with `sacct` or `squeue`")
    return rows


def slurm_state(job_id: str) -> JobState:
    """The job's state from sacct, else from squeue (accounting can lag behind a new job);
    UNKNOWN when neither knows it yet."""
    try:
        return JobState.from_slurm(status(job_id)[-1].state)
    except SubmitError:
        pass
    proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, check=False)
    words = proc.stdout.split()
    return JobState.from_slurm(words[0]) if proc.returncode == 0 and words else JobState.UNKNOWN


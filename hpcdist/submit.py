"""Submission through submitit, which keeps the job's lifecycle (state, results, requeue).

On a Slurm site submitit submits hpcdist's rendered script (not its own): ``ScriptExecutor``
overrides the one method that makes the script text, so ``hpcdist render`` shows byte for
byte what is submitted. On the local site submitit's LocalExecutor runs the ranks as processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import SubmitError
from hpcdist.polling import poll_until
from hpcdist.render import Origin, render, submitit_folder
from hpcdist.store.atomic import storage_umask

if TYPE_CHECKING:
    from hpcdist.postmortem import Ending

LOCAL_CONTROLLER = "hpcdist.runtime.local_controller"


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
            self.array = False  # the script has --array: even one task is an array task (ID_0)

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return self._script

        def _num_tasks(self) -> int:
            return self._tasks

        def _internal_process_submissions(self, delayed: list[Any]) -> list[Any]:
            """An array as submitit makes one (a pickle per task, jobs ``ID_INDEX``), but with
            this script (its ``--array``), not a plain SlurmExecutor's."""
            if len(delayed) == 1 and not self.array:
                return super()._internal_process_submissions(delayed)
            import uuid

            from submitit.core.utils import JobPaths
            from submitit.slurm.slurm import SlurmJob

            pickles = []
            for item in delayed:
                path = JobPaths.get_first_id_independent_folder(self.folder) / f"{uuid.uuid4().hex}.pkl"
                path.parent.mkdir(parents=True, exist_ok=True)
                item.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
                item.dump(path)
                pickles.append(path)
            first = self._submit_command(self._submitit_command_str)
            ranks = list(range(self._tasks))
            jobs: list[Any] = [SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=ranks)
                               for i in range(len(delayed))]
            for job, path in zip(jobs, pickles, strict=True):
                job.paths.move_temporary_file(path, "submitted_pickle")
            return jobs

    return ScriptExecutor


@functools.cache
def _local_executor_class() -> Callable[[Path], Any]:
    """submitit's LocalExecutor with hpcdist's controller (``hpcdist.runtime.local_controller``):
    the same environment submitit's ``start_controller`` passes, another module to run."""
    import submitit
    from submitit.local.local import LocalJob

    class ControllerExecutor(submitit.LocalExecutor):
        def _submit_command(self, command: str) -> Any:
            ntasks = self.parameters.get("tasks_per_node", 1)
            env = {
                **os.environ,
                "SUBMITIT_LOCAL_NTASKS": str(ntasks),
                "SUBMITIT_LOCAL_COMMAND": command,
                "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
                "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
                "SUBMITIT_LOCAL_NODEID": "0",
                "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                "SUBMITIT_STDERR_TO_STDOUT": "",
                "SUBMITIT_EXECUTOR": "local",
                "CUDA_VISIBLE_DEVICES": "",
                "SUBMITIT_LOCAL_WITH_SHELL": "",
            }
            process = subprocess.Popen([sys.executable, "-m", LOCAL_CONTROLLER, str(self.folder)], env=env)
            return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))

    return ControllerExecutor


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
    return submit_array(spec, [spec], site, origin)[0]


def _executor(spec: JobSpec, site: Site, folder: Path, script: str) -> Any:
    """submitit's executor for `site`, with the job's resources."""
    executor: Any
    if site.scheduler == "slurm":
        executor = _script_executor_class()(folder, script, _tasks(spec), site.preemption.max_requeues)
        executor.update_parameters(
            time=spec.time_limit_min(site),
            nodes=spec.resources.nodes,
            ntasks_per_node=spec.resources.tasks_per_node,
        )
    else:
        executor = _local_executor_class()(folder)
        executor.update_parameters(
            timeout_min=spec.time_limit_min(site),
            nodes=1,
            tasks_per_node=spec.resources.tasks_per_node,
        )
        os.environ[LAUNCH_TIME_VAR] = repr(time.time())
    return executor


def submit_array(base: JobSpec, tasks: list[JobSpec], site: Site, origin: Origin) -> list[Submission]:
    """Submit `base`'s script once, running `tasks` (one spec each, as a Slurm job array when
    there are several); one Submission per task, in order. On the local site there is no
    scheduler to hold a job back: ``--after`` is refused, and a sweep's tasks run one at a time
    (``hpcdist.cli`` waits for each)."""
    from submitit.core.utils import FailedJobError

    from hpcdist.runtime import run_rank  # the callable only; nothing runs here

    if site.scheduler != "slurm" and origin.after:
        raise SubmitError(f"site {site.name!r} has no scheduler to make a job wait for job {origin.after[0]}; "
                          f"submit the jobs in one `hpcdist submit A.yaml B.yaml --chain`, which runs them in order")
    if (origin.array_size or 1) != len(tasks) or (site.scheduler != "slurm" and len(tasks) > 1):
        raise SubmitError(f"{origin.job_path}: {len(tasks)} tasks for an array of {origin.array_size or 1} on site "
                          f"{site.name!r}; a local site runs a sweep's tasks one at a time")
    unset = [name for name in base.env_passthrough if name not in os.environ]
    if unset:
        raise SubmitError(
            f"env_passthrough: {', '.join(unset)} not set in this shell; the job takes it from the shell you "
            f"submit from: `export {unset[0]}=...` (or read it from a file) before `hpcdist submit`"
        )
    if site.scheduler == "slurm" and shutil.which("sbatch") is None:
        raise SubmitError(f"site {site.name!r} uses Slurm but `sbatch` is not on PATH; run on a login node")
    script = render(base, site, origin)
    try:
        with storage_umask(site.storage.umask), (  # submitit's files, and the job's through sbatch
                _detached_streams() if site.scheduler != "slurm" else contextlib.nullcontext()):
            executor = _executor(base, site, submitit_folder(base, site), script)
            if origin.array_size is None:
                jobs = [executor.submit(run_rank, tasks[0], site)]
            else:
                executor.array = True
                with executor.batch():
                    pending = [executor.submit(run_rank, task, site) for task in tasks]
                jobs = list(pending)
    except FailedJobError as exc:
        raise SubmitError(f"the scheduler refused job {base.name!r}: {_first_error_line(str(exc))}") from exc
    except OSError as exc:
        raise SubmitError(f"could not submit job {base.name!r}: {exc}") from exc
    from hpcdist.jobindex import add  # the index of submitted jobs: `hpcdist jobs`, `logs`, `wait`, `cancel`

    submissions = [Submission(job=job, spec=task, site=site, script=script)
                   for job, task in zip(jobs, tasks, strict=True)]
    for submission in submissions:
        add(submission, origin)
    return submissions


@contextlib.contextmanager
def _detached_streams() -> Iterator[None]:
    """Standard streams on /dev/null while submitit starts a local job's controller, which
    outlives `submit`: holding our stdout, it would keep `$(hpcdist submit ...)` or a pipe to
    `tee` open until the job ends. The ranks write to their own log files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        yield
    finally:
        for fd, copy in zip((0, 1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


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


def wait(
    sub: Submission, poll_s: float = 1.0, timeout_s: float | None = None,
    on_poll: Callable[[JobState], None] | None = None,
) -> Finished:
    """Block until the scheduler says the job ended; its final state and one outcome per rank.

    Waiting ends on the scheduler's word (Slurm's accounting, or squeue), not on submitit's
    result files, which a job that dies early never writes. A rank without a result is
    summarised by how srun saw it end (killed by a signal, its exit code) or else the first real
    error line of its log; a failed job's ``cause`` names the rank and host that went first and
    Slurm's word on the job (cancelled, node failure, out of memory; ``hpcdist.postmortem``).
    ``timeout_s=None`` waits as long as the scheduler says the job is not done; a Slurm job that
    left the queue while accounting is down ends the wait with a `SubmitError` (``Vanished``).
    `on_poll` sees each state read (the live status line).
    """
    from submitit.core.utils import FailedJobError, UncompletedJobError

    vanished = Vanished()

    def ended() -> JobState | None:
        state = job_state(sub)
        if on_poll is not None:
            on_poll(state)
        if state.final:
            return state
        if sub.site.scheduler == "slurm" and vanished.gone(state):
            raise SubmitError(Vanished.message(sub.job_id))
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
    from hpcdist.postmortem import accounting, ending  # only a job that failed is looked into

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
    reason: str = ""  # squeue's %r: why a pending job waits (Resources, Priority, Dependency)


_JOB_ID = re.compile(r"\d+(_\d+)?")


def _check_ids(job_ids: Sequence[str]) -> None:
    for job_id in job_ids:
        if not _JOB_ID.fullmatch(job_id):
            raise SubmitError(f"job id {job_id!r} is not a Slurm job id (digits, e.g. 1234)")


def sacct_rows(job_ids: Sequence[str]) -> list[JobStatus]:
    """The jobs' records in Slurm's accounting (one row per requeue-visible record, oldest first)."""
    _check_ids(job_ids)
    if shutil.which("sacct") is None:
        raise SubmitError("`sacct` is not on PATH; this needs Slurm's accounting")
    proc = subprocess.run(
        ["sacct", "-j", ",".join(job_ids), "-X", "-P", "-n", "-o", "JobID,JobName,State,ExitCode,Elapsed,NodeList"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SubmitError(f"sacct failed for job {','.join(job_ids)}: {proc.stderr.strip()}")
    return [JobStatus(*line.split("|")[:6]) for line in proc.stdout.splitlines() if line.strip()]


def squeue_rows(job_ids: Sequence[str]) -> dict[str, JobStatus]:
    """The jobs Slurm still has in its queue (pending, running, completing), by job id; empty when
    squeue is missing or fails. Elapsed is squeue's %M, nodes %N, reason %r."""
    _check_ids(job_ids)
    if not job_ids or shutil.which("squeue") is None:
        return {}
    proc = subprocess.run(
        ["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%j|%T|%M|%N|%r"],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        return {}
    rows = {}
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 6:
            rows[parts[0]] = JobStatus(parts[0], parts[1], parts[2], "", parts[3], parts[4], parts[5])
    return rows


def status(job_id: str) -> list[JobStatus]:
    """The job's state from Slurm's accounting (one row per requeue-visible record)."""
    rows = sacct_rows([job_id])
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
    queued = squeue_rows([job_id]).get(job_id)
    return JobState.from_slurm(queued.state) if queued else JobState.UNKNOWN


GONE_AFTER_S = 5.0  # how long a job may be unknown to squeue and sacct before a waiter gives up


class Vanished:
    """One rule for every waiter (``wait``, ``hpcdist logs -f``): a job that neither squeue nor
    sacct knows, on two reads at least `after_s` apart, has left the queue while accounting is
    down; its end state will not come, so waiting longer would wait forever."""

    def __init__(self, after_s: float = GONE_AFTER_S) -> None:
        self.after_s = after_s
        self.since: float | None = None
        self.reads = 0

    def gone(self, state: JobState) -> bool:
        """`state` is the newest read; True once the job counts as gone."""
        if state is not JobState.UNKNOWN:
            self.since, self.reads = None, 0
            return False
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.reads += 1
        return self.reads >= 2 and now - self.since >= self.after_s

    @staticmethod
    def message(job_id: str, then: str = "") -> str:
        """The line a waiter ends with; `then` is what to do next (default: read the job's logs)."""
        return (f"job {job_id} left the queue and Slurm's accounting (sacct) is unavailable, so how it ended "
                f"is unknown; {then or f'look at `hpcdist logs {job_id}`'}")

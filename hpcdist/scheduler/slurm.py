"""The one client of Slurm's commands for jobs: sbatch, squeue, sacct, scontrol, scancel (what a
cluster and its nodes are, from scontrol and sinfo, is ``slurm_cluster``'s, through ``run`` here).

Every call has a timeout (``HPCDIST_SLURM_TIMEOUT_S``, 30 s) and is tried again when it fails or
times out (``HPCDIST_SLURM_TRIES``, 3: slurmctld restarting, a busy controller); what still fails
means *unknown*, never *gone*: only a successful answer that does not list a job counts as its
absence (``Reading.absent``). Job ids are checked once, here, before they reach a command line.
``hpcdist.scheduler.slurm_watch.Watcher`` batches the queries of many jobs into one squeue and one
sacct call and keeps them, as submitit's ``SlurmInfoWatcher`` does. Standard library only: the
nodes requeue through it too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpcdist.errors import SubmitError
from hpcdist.scheduler import ssh
from hpcdist.scheduler.states import JobState

JOB_ID = re.compile(r"\d+(_\d+)?")  # a job, or an array task as sacct and submitit name it (ARRAYID_INDEX)
TIMEOUT_VAR, TRIES_VAR = "HPCDIST_SLURM_TIMEOUT_S", "HPCDIST_SLURM_TRIES"
# What Slurm says of an id it does not know (forgotten after MinJobAge, or never existed): an answer, not a failure.
_UNKNOWN_ID = "Invalid job id"
_TIMEOUT_HINT = f"set {TIMEOUT_VAR} to wait longer"


def is_job_id(text: str) -> bool:
    return bool(JOB_ID.fullmatch(text))


def check_job_ids(job_ids: Sequence[str]) -> None:
    for job_id in job_ids:
        if not is_job_id(job_id):
            raise SubmitError(f"job id {job_id!r} is not a Slurm job id (digits: 1234, or 1234_5 for an array task)")


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_VAR) or 30.0)


def tries() -> int:
    return max(1, int(os.environ.get(TRIES_VAR) or 3))


@dataclass(frozen=True)
class Answer:
    """What a command said: its output when it succeeded, else why not (after every try)."""

    ok: bool
    out: str = ""
    err: str = ""
    why: str = ""  # "" when ok; else "`squeue` timed out after 30 s (3 tries)", "... exited 1: ..."


def run(argv: Sequence[str], *, retry: bool = True, timeout: float | None = None,
        env: dict[str, str] | None = None) -> Answer:
    """`argv` (a Slurm command) with a timeout, tried again on failure unless `retry` is False
    (commands that must not run twice: sbatch, scontrol requeue). An unknown job id is an answer.
    Under ``--on HOST`` it runs on that login node through ssh (``hpcdist.scheduler.ssh``)."""
    program = argv[0]
    remote = ssh.login()
    if not remote and shutil.which(program) is None:
        return Answer(False, why=f"`{program}` is not on PATH (run this on a login node of the cluster)")
    limit = timeout or timeout_s()
    attempts = tries() if retry else 1
    why = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(0.5 * 2.0 ** (attempt - 1), 4.0))
        try:
            proc = (ssh.run(argv, limit) if remote else
                    subprocess.run(list(argv), capture_output=True, text=True, timeout=limit, check=False, env=env))
        except ssh.Unreachable as exc:
            why = str(exc)
            continue
        except subprocess.TimeoutExpired:
            why = f"`{program}` did not answer within {limit:g} s ({_TIMEOUT_HINT})"
            continue
        except OSError as exc:
            why = f"`{program}` could not run: {exc}"
            continue
        if proc.returncode == 0 or _UNKNOWN_ID in proc.stderr:
            return Answer(True, proc.stdout, proc.stderr)
        why = f"`{' '.join(argv[:2])}` exited {proc.returncode}: {proc.stderr.strip()[:300] or '(no message)'}"
    return Answer(False, why=why + (f" ({attempts} tries)" if attempts > 1 else ""))


# ---------------------------------------------------------------- the queue and the accounting


@dataclass(frozen=True)
class JobStatus:
    """One job as squeue or sacct shows it."""

    job_id: str
    name: str
    state: str
    exit_code: str
    elapsed: str
    nodes: str
    reason: str = ""  # squeue's %r: why a pending job waits (Resources, Priority, Dependency)
    restarts: str = ""  # squeue's RestartCnt: how often Slurm started it again ("" where not asked)


def sacct_rows(job_ids: Sequence[str]) -> list[JobStatus]:
    """The jobs' records in Slurm's accounting (one row per requeue-visible record, oldest
    first); a SubmitError when accounting cannot be read."""
    check_job_ids(job_ids)
    if not job_ids:
        return []
    answer = run(["sacct", "-j", ",".join(job_ids), "-X", "-P", "-n", "-o",
                  "JobID,JobName,State,ExitCode,Elapsed,NodeList"])
    if not answer.ok:
        raise SubmitError(f"Slurm's accounting could not be read for job {','.join(job_ids)}: {answer.why}")
    return [JobStatus(*line.split("|")[:6]) for line in answer.out.splitlines() if line.count("|") >= 5]


def sacct_steps(job_id: str) -> list[str] | None:
    """sacct's lines for the job and its steps (``JobID|State|ExitCode|DerivedExitCode|NodeList``);
    None when accounting cannot be read."""
    check_job_ids([job_id])
    answer = run(["sacct", "-j", job_id, "-P", "-n", "-o", "JobID,State,ExitCode,DerivedExitCode,NodeList"])
    return [line for line in answer.out.splitlines() if line.count("|") >= 4] if answer.ok else None


def squeue_rows(job_ids: Sequence[str]) -> dict[str, JobStatus] | None:
    """The jobs slurmctld still holds, by job id: queued, running, and those that ended within its
    ``MinJobAge`` (300 s by default) with their final state (``--states=all``), the controller's
    own word while accounting may still be a step behind (a job just ended that sacct still
    shows PENDING). A job not in the dict has left the controller. None when squeue could not be
    asked: unknown, not empty."""
    check_job_ids(job_ids)
    if not job_ids:
        return {}
    answer = run(["squeue", "-h", "--states=all", "-j", ",".join(job_ids), "-o", "%i|%j|%T|%M|%N|%r"])
    if not answer.ok:
        return None
    rows = {}
    for line in answer.out.splitlines():
        parts = line.split("|")
        if len(parts) == 6:
            rows[parts[0]] = JobStatus(parts[0], parts[1], parts[2], "", parts[3], parts[4], parts[5])
    return rows


# squeue -O: each field then "|"; the name last, as it may hold anything
_QUEUE_FIELDS = "JobArrayID:|,Name:|,State:|,TimeUsed:|,NodeList:|,Reason:|,RestartCnt:|"


def my_queue() -> dict[str, JobStatus] | None:
    """Every job of this user slurmctld holds (as ``squeue_rows``, one row per array task), with
    its restart count: one question whatever the number of jobs, and a light one (``--me`` loads
    her jobs alone; ``-j`` with several ids loads the cluster's). None when squeue could not be asked."""
    answer = run(["squeue", "-h", "--me", "-r", "--states=all", "-O", _QUEUE_FIELDS])
    if not answer.ok:
        return None
    rows = {}
    for line in answer.out.splitlines():
        job, _, rest = line.partition("|")
        fields = rest.removesuffix("|").rsplit("|", 5)
        if is_job_id(job.strip()) and len(fields) == 6:
            name, state, used, nodes, reason, restarts = (f.strip() for f in fields)
            rows[job.strip()] = JobStatus(job.strip(), name, state, "", used, nodes, reason, restarts)
    return rows


def job_steps(job_id: str) -> set[str] | None:
    """The steps of a job that run now (``0``, ``1``, ``batch``); None when squeue could not be asked."""
    check_job_ids([job_id])
    answer = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"])
    if not answer.ok:
        return None
    return {line.strip().rpartition(".")[2] for line in answer.out.splitlines() if "." in line}


@dataclass(frozen=True)
class JobInfo:
    """``scontrol show job``'s word on a job: its state, how often Slurm restarted it, the nodes
    it must not run on and how many it asks for."""

    state: JobState
    word: str  # Slurm's own word (PENDING, REQUEUE_HOLD, ...)
    restarts: int
    excluded: str = ""  # ExcNodeList as Slurm writes it (n[3-4]), "" for none
    required: str = ""  # ReqNodeList (the user's --nodelist), "" for none
    num_nodes: str = ""  # NumNodes: "4", or "3-4" while a job that may shrink is pending
    submitted: str = ""  # SubmitTime; a requeue sets it: when the run before ended (2026-11-24T02:30:25)
    user: str = ""  # UserId's name: whose job it is (Slurm shows every user's jobs, as without PrivateData)
    batch_host: str = ""  # BatchHost: the node that ran (runs) its batch script, "" for none yet
    nodes: str = ""  # NodeList: the nodes of its run (n[1-3]), "" for none


def show_job(job_id: str) -> JobInfo | None:
    """The job as slurmctld has it now, or None when it cannot be asked or has forgotten it."""
    check_job_ids([job_id])
    answer = run(["scontrol", "-o", "show", "job", job_id])
    if not answer.ok or not answer.out.strip():
        return None
    fields = dict(f.split("=", 1) for f in answer.out.split() if "=" in f)
    try:
        excluded, required = (fields.get(k, "").replace("(null)", "") for k in ("ExcNodeList", "ReqNodeList"))
        return JobInfo(JobState.from_slurm(fields["JobState"]), fields["JobState"], int(fields.get("Restarts", "0")),
                       excluded=excluded, required=required, num_nodes=fields.get("NumNodes", ""),
                       submitted=fields.get("SubmitTime", ""), user=fields.get("UserId", "").split("(")[0],
                       batch_host=fields.get("BatchHost", "").replace("(null)", ""),
                       nodes=fields.get("NodeList", "").replace("(null)", ""))
    except (KeyError, ValueError):
        return None


def update_job(job_id: str, **fields: str) -> None:
    """``scontrol update JobId=ID Key=Value...`` (``ExcNodeList``, ``NumNodes``, ``StartTime``);
    the same update twice does no harm, so it is tried again like a query."""
    check_job_ids([job_id])
    for key, value in fields.items():
        if not re.fullmatch(r"[A-Za-z]+", key) or not re.fullmatch(r"[A-Za-z0-9_.,\[\]:-]*", value):
            raise SubmitError(f"scontrol update {key}={value!r}: not a field and value hpcdist writes")
    answer = run(["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())])
    if not answer.ok:
        raise SubmitError(f"could not update job {job_id} ({', '.join(fields)}): {answer.why}")


@dataclass(frozen=True)
class Attempt:
    """One run of a job in Slurm's accounting (``sacct --duplicates``: a requeued job has one per
    start): how it ended, on which nodes, and when (``2026-11-24T02:30:25``, the cluster's time)."""

    state: str
    nodes: str
    end: str


def attempts(job_id: str) -> list[Attempt] | None:
    """Every run of the job, oldest first; None when accounting cannot be read."""
    check_job_ids([job_id])
    answer = run(["sacct", "-j", job_id, "--duplicates", "-X", "-P", "-n", "-o", "State,NodeList,End"])
    if not answer.ok:
        return None
    return [Attempt(*line.split("|")[:3]) for line in answer.out.splitlines() if line.count("|") >= 2]


def scancel(job_id: str) -> None:
    check_job_ids([job_id])
    answer = run(["scancel", job_id])
    if not answer.ok:
        raise SubmitError(f"could not cancel job {job_id}: {answer.why}")


def kill_step(job_id: str, step: str) -> subprocess.Popen[bytes]:
    """``scancel --signal=KILL JOB.STEP``, started and not waited for (its process returned, to
    be reaped): slurmctld answers only once every node of the step did, and a dead node answers
    after MessageTimeout, while the live nodes act at once."""
    check_job_ids([job_id])
    if not step.isdigit():
        raise ValueError(f"not a job step number: {step!r}")
    return subprocess.Popen(ssh.argv_for(["scancel", "--signal=KILL", f"{job_id}.{step}"]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def requeue(job_id: str) -> None:
    """``scontrol requeue``: once (a second try could requeue the job's next start). A job with
    spare nodes is submitted ``--no-requeue`` (its batch node's death ends it, for its standby job:
    ``hpcdist.runtime.standby``), which Slurm refuses to requeue: it is made requeueable first."""
    check_job_ids([job_id])
    run(["scontrol", "update", f"JobId={job_id}", "Requeue=1"])  # where it fails, the requeue's own error says why
    answer = run(["scontrol", "requeue", job_id], retry=False, timeout=max(timeout_s(), 60.0))
    if not answer.ok:
        raise SubmitError(f"could not requeue job {job_id}: {answer.why}")


class Refused(SubmitError):
    """sbatch did not queue the job (its own error line, or why it could not be asked)."""


# A launch's identity of one process (mpirun, srun --mpi=pmix, a notebook's singleton MPI_Init):
# exported by sbatch to every task, PMIX_RANK=0 made each task of the job take itself for rank 0.
_LAUNCH_IDENTITY = ("PMIX_", "PMI_RANK", "PMI_SIZE", "PMI_FD", "OMPI_COMM_WORLD_", "OMPI_MCA_ess",
                    "OMPI_MCA_orte_launch", "OMPI_MCA_orte_ess_")


def submit_env(env: Mapping[str, str]) -> dict[str, str]:
    """What sbatch hands the job: `env` as Python holds it (not MPI_Init's C setenv), less that identity."""
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCH_IDENTITY)}


def sbatch(script: str | os.PathLike[str], options: Sequence[str] = (), args: Sequence[str] = (),
           env: Mapping[str, str] | None = None) -> str:
    """Submit a batch script; Slurm's job id. Once, with the timeout: a retry could queue it twice.
    `options` come before the script (they win over its ``#SBATCH`` lines), `args` are the
    script's own; `env` is what the job gets (this process's by default)."""
    answer = run(["sbatch", "--parsable", *options, os.fspath(script), *args], retry=False,
                 timeout=max(timeout_s(), 60.0), env=submit_env(os.environ if env is None else env))
    if not answer.ok:
        raise Refused(answer.why)
    job_id = answer.out.strip().split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"
    if not is_job_id(job_id):
        raise Refused(f"sbatch answered {answer.out.strip()!r}, not a job id")
    return job_id


# ---------------------------------------------------------------- one job's state


@dataclass(frozen=True)
class Reading:
    """A job's state at one read, and whether the answer proves the job is gone: squeue answered
    without it and accounting had nothing (down, or not yet). A failed command is UNKNOWN and
    not absent. `asked`: when the answer was asked (monotonic), which tells a new one from a kept one."""

    state: JobState
    row: JobStatus | None = None  # sacct's newest record, else squeue's row
    absent: bool = False
    asked: float = 0.0


def readings_of(job_ids: Sequence[str], queue: dict[str, JobStatus] | None,
                asked: float) -> tuple[dict[str, Reading], str]:
    """Each job's reading from `queue` (squeue's answer, the controller's word on a queued,
    running or just ended job; None: squeue could not be asked), then sacct for the ones it does
    not hold; and why accounting could not be read ("" when it could)."""
    rest = [j for j in job_ids if queue is None or j not in queue]
    accounted: dict[str, JobStatus] = {}
    error = ""
    if rest:
        try:
            for row in sacct_rows(rest):
                accounted[row.job_id] = row  # the newest record of a requeued job wins
        except SubmitError as exc:
            error = str(exc)
    out = {}
    for job_id in job_ids:
        queued = None if queue is None else queue.get(job_id)
        if queued is not None:
            out[job_id] = Reading(JobState.from_slurm(queued.state), queued, asked=asked)
        elif job_id in accounted:
            out[job_id] = Reading(JobState.from_slurm(accounted[job_id].state), accounted[job_id], asked=asked)
        else:
            out[job_id] = Reading(JobState.UNKNOWN, absent=queue is not None, asked=asked)
    return out, error


def read_state(job_id: str) -> Reading:
    """One job's state now (squeue, then sacct; uncached: ``slurm_watch.Watcher`` batches and keeps)."""
    return readings_of([job_id], squeue_rows([job_id]), time.monotonic())[0][job_id]


GONE_AFTER_S = 5.0  # how long a job may be proven absent before a waiter gives up


class Vanished:
    """One rule for every waiter (``wait``, ``hpcdist logs -f``): a job that squeue answered
    without and accounting does not know, on two reads at least `after_s` apart, has left the
    queue while accounting is down; its end state will not come. A read that could not ask
    (squeue failing or timing out) proves nothing and does not count."""

    def __init__(self, after_s: float = GONE_AFTER_S) -> None:
        self.after_s = after_s
        self.since: float | None = None
        self.reads = 0

    def gone(self, reading: Reading) -> bool:
        """`reading` is the newest; True once the job counts as gone."""
        if reading.state is not JobState.UNKNOWN:
            self.since, self.reads = None, 0
            return False
        if not reading.absent:
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

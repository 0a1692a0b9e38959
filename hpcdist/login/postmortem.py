"""How a Slurm job ended, and which rank and host went first: from Slurm's accounting and the logs.

A rank killed by a signal writes nothing about it, so its own log ends on whatever it last
logged; the ranks that survive it report their transport's complaint ("Connection closed by
peer"). What did happen is known to Slurm: sacct's steps (State, ExitCode ``code:signal``,
DerivedExitCode, NodeList) and the lines srun and slurmstepd write into the batch log
(``srun: error: n2: task 1: Killed``, ``*** STEP 7.0 ON n1 CANCELLED AT ... DUE TO NODE FAILURE ***``,
``Detected 1 oom_kill event``), in the order things happened, and hpcdist's own line when a
requeued run ended before its ranks started (``config.contract.STOPPED``). The parsers are pure
functions of that text; ``accounting`` asks the Slurm client (``scheduler.slurm``). Login side
(the waiter, ``JobHandle``, the exclusions); standard library only.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from hpcdist.config.contract import STOPPED
from hpcdist.scheduler.hostlist import expand_hostlist, task_end
from hpcdist.scheduler.states import JobState
from hpcdist.store.records import last_error
from hpcdist.store.records.stackrecord import describe, read_stacks

if TYPE_CHECKING:
    from hpcdist.config.paths import JobPaths


@dataclass(frozen=True)
class StepRecord:
    """One sacct line: the job, its batch/extern steps or a numbered step."""

    step: str  # "707", "707.batch", "707.0"
    state: str  # sacct's words, e.g. "CANCELLED by 0"
    exit_code: str  # "code:signal"
    derived: str
    nodes: str

    @property
    def signal(self) -> int:
        """The signal that ended the step's process (0: none), from ExitCode's second field."""
        try:
            return int(self.exit_code.split(":")[1])
        except (IndexError, ValueError):
            return 0


@dataclass(frozen=True)
class TaskEnd:
    """How srun saw one task end, in the order it reported them."""

    rank: int
    host: str
    how: str  # "killed by SIGKILL", "exited with code 1", "out of memory", ...
    order: int


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# srun's words for a task's end (its strsignal text, or its own phrases) as what happened.
_SRUN_WORDS = {
    "killed": "killed by SIGKILL", "terminated": "killed by SIGTERM", "segmentation fault": "killed by SIGSEGV",
    "aborted": "killed by SIGABRT", "bus error": "killed by SIGBUS", "hangup": "killed by SIGHUP",
    "interrupt": "killed by SIGINT", "floating point exception": "killed by SIGFPE",
    "illegal instruction": "killed by SIGILL", "out of memory": "out of memory",
    "user defined signal 1": "killed by SIGUSR1", "user defined signal 2": "killed by SIGUSR2",
}
_EXIT = re.compile(r"exited with exit code (\d+)", re.IGNORECASE)
_STEPD = re.compile(r"\*\*\* (?:STEP|JOB) [\d.]+ ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?(?: \*\*\*|$)")
_OOM = re.compile(r"Detected \d+ oom[_-]kill events? in (?:StepId=)?\S+", re.IGNORECASE)


def task_ends(log: str) -> list[TaskEnd]:
    """Each task srun reported ending with a signal or a non-zero code, first first."""
    ends: list[TaskEnd] = []
    seen: set[int] = set()
    for line in log.splitlines():
        end = task_end(line)
        if end is None:
            continue
        host, ranks, words = end
        code = _EXIT.search(words)
        how = f"exited with code {code.group(1)}" if code else _SRUN_WORDS.get(words.lower(), words)
        for rank in ranks:
            if rank not in seen:
                seen.add(rank)
                ends.append(TaskEnd(rank, host, how, len(ends)))
    return ends


def job_event(log: str) -> str:
    """slurmstepd's or srun's word on the whole job or step: cancelled (and why), or out of memory."""
    for line in log.splitlines():
        match = _STEPD.search(line)
        if match:
            host, why = match.groups()
            return f"cancelled on {host}" + (f" due to {why.lower()}" if why else "")
        if _OOM.search(line):
            return "out of memory (the kernel's OOM killer ended a task)"
    return ""


def stopped(log: str) -> str:
    """Why a requeued run ended before its ranks started, as it wrote it (``STOPPED``), or ""."""
    lines = [line for line in log.splitlines() if line.startswith(STOPPED)]
    return lines[-1].removeprefix(STOPPED).strip() if lines else ""


def accounting(job_id: str) -> list[StepRecord]:
    """The job's sacct records, steps included; [] when accounting is not available."""
    from hpcdist.scheduler.slurm import is_job_id, sacct_steps

    lines = sacct_steps(job_id) if is_job_id(job_id) else None
    return [StepRecord(*line.split("|")[:5]) for line in lines or []]


_JOB_STATES = {  # the allocation's own end, said in words (sacct State's first word)
    "CANCELLED": "cancelled", "NODE_FAIL": "node failure", "OUT_OF_MEMORY": "out of memory",
    "TIMEOUT": "time limit reached", "PREEMPTED": "preempted", "DEADLINE": "deadline reached",
    "BOOT_FAIL": "node boot failure",
}


def job_cause(records: list[StepRecord]) -> str:
    """What Slurm's accounting says ended the job, in words, or "" for a plain FAILED/COMPLETED."""
    for rec in records:
        word = rec.state.split(" ")[0].rstrip("+").upper()
        if word in _JOB_STATES:
            by = rec.state.split(" by ")[1] if " by " in rec.state else ""
            nodes = ", ".join(expand_hostlist(rec.nodes)) if rec.nodes and word != "CANCELLED" else ""
            return (_JOB_STATES[word] + (f" (by uid {by})" if by else "") + (f" on {nodes}" if nodes else "")
                    + f" [sacct: {rec.step} {rec.state}, exit {rec.exit_code}]")
    for rec in records:
        if rec.signal:
            return f"step {rec.step} killed by {signal_name(rec.signal)} [sacct: {rec.state}, exit {rec.exit_code}]"
    return ""


def node_failure_suspects(records: list[StepRecord]) -> list[str]:
    """The nodes of the records Slurm ended with NODE_FAIL: the dead node is among them (sacct
    names the whole allocation; which one died is what Slurm's node states say now)."""
    nodes: list[str] = []
    for rec in records:
        if rec.state.split(" ")[0].rstrip("+").upper() == "NODE_FAIL" and rec.nodes:
            nodes += [n for n in expand_hostlist(rec.nodes) if n not in nodes]
    return nodes


class Outcome(Protocol):
    """A rank's outcome as the login side has it (``hpcdist.login.watch.TaskOutcome``)."""

    rank: int
    ok: bool
    error: str


Out = TypeVar("Out", bound=Outcome)


@dataclass(frozen=True)
class Ending:
    """What went first, for the per-rank summary: the first task srun saw end, and the job's cause."""

    tasks: dict[int, TaskEnd]
    first: TaskEnd | None
    cause: str  # the job-level cause (cancelled, node failure, out of memory, ...), or ""
    stopped: str = ""  # the run's own node failure check ended it (``STOPPED``): why, else ""
    said: str = ""  # the last words of the rank that went first (``heard``), else ""

    def state(self, scheduler_state: JobState) -> JobState:
        """The job's end as hpcdist says it: a run its own node failure check ended (Slurm: FAILED,
        exit 3) ended NODE_FAIL, as the waiter's verdict on the same failure does; one verdict, one state."""
        return JobState.NODE_FAIL if self.stopped and scheduler_state is JobState.FAILED else scheduler_state

    def naming(self, outcomes: Sequence[Outcome]) -> Ending:
        """This ending with the rank that failed first (``first_failure``) as the one that went
        first, where the rank srun saw end first says it failed after another; else itself (a
        rank killed first, by a signal or the OOM killer, stays first)."""
        from hpcdist.config.contract import is_after_first

        cause = first_failure(outcomes)
        seen_first = next((o for o in outcomes if self.first is not None and o.rank == self.first.rank), None)
        if cause is None or seen_first is None or not is_after_first(seen_first.error) or cause.rank not in self.tasks:
            return self
        return replace(self, first=self.tasks[cause.rank])

    def heard(self, paths: JobPaths) -> Ending:
        """This ending with the last words of the rank that went first (``hpcdist.store.records.last_error``;
        after ``naming``): a rank its backend aborted (NCCL's watchdog: SIGABRT) is named by the
        error it wrote before."""
        got = last_error.read(paths.last_words(self.first.rank)) if self.first is not None else None
        return replace(self, said=got[0] if got is not None else "")

    def headline(self) -> str:
        """One line: which rank and host went first and how (its own error first, where it left
        last words), and the job-level cause."""
        parts = []
        if self.first is not None:
            how = f"{self.said} (then {self.first.how})" if self.said else self.first.how
            parts.append(f"rank {self.first.rank} on {self.first.host} went first: {how}")
        if self.cause:
            parts.append(self.cause)
        return "; ".join(parts)

    def after(self, rank: int) -> str:
        """For a rank that failed after another went first: which, where and how; else ""."""
        first = self.first
        if first is None or first.rank == rank:
            return ""
        how = f"was {first.how}" if first.how.startswith("killed") else (
            "ran out of memory" if first.how == "out of memory" else first.how)
        return f"after rank {first.rank} on {first.host} {how}"


def ending(batch_log: str, records: list[StepRecord]) -> Ending:
    """Read srun's task lines and slurmstepd's events from the batch log, and the job's cause."""
    tasks = task_ends(batch_log)
    accounted, event = job_cause(records), job_event(batch_log)
    own = stopped(batch_log)
    cause = "; ".join(c for c in (own, accounted, event) if c)
    return Ending({t.rank: t for t in tasks}, tasks[0] if tasks else None, cause, own)


def timeout_stacks(files: dict[int, Path], world_size: int, verbose: bool = False) -> list[str]:
    """The ranks' stacks written when a collective or the rendezvous timed out, grouped as
    `hpcdist stacks` groups them (``stackrecord.describe``); [] when no rank timed out. Only the
    answers of the last minute before the newest timeout count: an earlier run's are not this one's."""
    got = read_stacks(files)
    timed = [s.written for s in got.values() if s.timed_out]
    if not timed:
        return []
    return describe({r: s for r, s in got.items() if s.written >= max(timed) - 60.0}, world_size, verbose)


def first_failure(outcomes: Sequence[Out]) -> Out | None:
    """The failed rank to name first: the lowest one whose error is its own, not one that failed
    after another rank had (its connections to it broke, the watchdog stopped it)."""
    from hpcdist.config.contract import is_after_first

    failed = [o for o in outcomes if not o.ok]
    return next((o for o in failed if not is_after_first(o.error)), failed[0] if failed else None)


# ---------------------------------------------------------------- a rank's own words


def no_result(path: Path, state: JobState, rank: int, end: Ending | None, paths: JobPaths | None = None) -> str:
    """Why a rank left no result: the error it wrote before its backend ended it (NCCL's watchdog),
    how srun saw it end, or the job's cause, or its log's first error."""
    task = end.tasks.get(rank) if end else None
    words = last_error.read(paths.last_words(rank)) if paths is not None else None
    if words is not None:  # its own error, then how it ended
        return words[0] + (f" (then {task.how} on {task.host})" if task is not None else " (then it ended, no result)")
    if end is not None and task is not None:
        first = "the first rank to end" if end.first == task else end.after(rank)
        if task.how.startswith("exited"):  # its own log says why: keep that, add srun's word
            return f"{log_error(path, state)} ({task.how} on {task.host}, {first})"
        return f"{task.how} on {task.host} ({first}); no result"
    if end is not None and end.cause:
        return f"no result; the job ended: {end.cause}"
    return log_error(path, state)


def log_error(path: Path, state: JobState) -> str:
    """The first real error line of a rank's log, or why there is none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"no result and no log ({path}); the job ended {state.value} before this rank started"
    line = first_error_line(text, first=True)
    return f"no result; {line}" if line != "(no output)" else f"no result and an empty log ({path})"


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")
_SLURM_LINE = re.compile(r"^(?:srun|slurmstepd|mpirun|torchrun)[^:]*: (?:error|error:)?\s*(.+)$", re.IGNORECASE)
_NOT_THE_CAUSE = {"FailedJobError", "UncompletedJobError", "ChildFailedError"}


def first_error_line(text: str, first: bool = False) -> str:
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

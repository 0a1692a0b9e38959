"""Waiting for a submitted job, and how it ended: the scheduler's word until it is final
(``wait``: squeue, then Slurm's accounting; on the local site submitit's controller), each rank's
outcome from its result file or, for a rank that left none, its last words, how srun saw it end or
its log (``outcomes``), and the job's cause (``hpcdist.login.postmortem``). ``watch`` is
``wait`` with the status line: the state, elapsed time, why it is pending, and rank 0's newest
progress; in place on a terminal, a line per change (at most every 10 s) in a pipe or a log.
``submit --wait``, ``hpcdist wait`` and ``JobHandle.wait`` use it.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcdist.errors import SubmitError
from hpcdist.files.trust import load_pickle  # a result pickle another user could have written: refused
from hpcdist.login import remote
from hpcdist.login.standby import standby_record, successor
from hpcdist.login.submit import Submission
from hpcdist.polling import poll_until
from hpcdist.scheduler import slurm, slurm_watch
from hpcdist.scheduler.slurm import Vanished
from hpcdist.scheduler.states import JobState

if TYPE_CHECKING:
    from hpcdist.login.postmortem import Ending
    from hpcdist.scheduler.slurm_now import Reservation


@dataclass
class TaskOutcome:
    rank: int
    ok: bool
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    traceback: str = ""  # the rank's traceback, when it raised


@dataclass(frozen=True)
class Finished:
    """What ``wait`` learnt: the scheduler's final state and one outcome per rank."""

    state: JobState
    outcomes: list[TaskOutcome]
    cause: str = ""  # which rank and host went first and how, and Slurm's cause (cancelled, ...)
    stacks: tuple[str, ...] = ()  # every rank's stack when a collective or the rendezvous timed out, grouped
    note: str = ""  # a rank found no GPU in a job that asked none on a node that has some (``plan.no_gpu_note``)

    @property
    def ok(self) -> bool:
        """Success means both: the scheduler says COMPLETED and every rank returned a result."""
        return self.state is JobState.COMPLETED and all(o.ok for o in self.outcomes)


# Every Slurm job this process waits for is read in one squeue (and one sacct) with the others it
# waits for, less often as they age, and with the user's other processes through a file in her
# state folder (``hpcdist.scheduler.slurm_watch``): 50 handles of one array, or 20 `submit --wait`
# at once, cost one query per poll, not 50; the watcher keeps final states and asks only for the others.
_SHARED = slurm_watch.Watcher(backoff=True)
_WATCHED: dict[str, None] = {}


def watch_together(job_ids: list[str]) -> None:
    """Jobs this process will wait for (an Executor's submissions, just queued): read together from
    now on, the first time after the first interval (``slurm_watch.Watcher.queued``)."""
    _WATCHED.update(dict.fromkeys(job_ids))
    _SHARED.queued(job_ids)


def hurry() -> None:
    """Read the queue again within a second: a job's end is near (its rank 0 returned)."""
    _SHARED.hurry()


def _slurm_reading(job_id: str) -> slurm.Reading:
    from hpcdist.login.jobindex import state_dir
    from hpcdist.scheduler import queue_cache, ssh

    _WATCHED[job_id] = None
    _SHARED.shared = queue_cache.path_in(state_dir() / "queue", ssh.login())  # this cluster's, as now reached
    return _SHARED.readings(list(_WATCHED))[job_id]


def read_state(sub: Submission) -> slurm.Reading:
    """The scheduler's current word on the job (Slurm: squeue, else sacct, read with the other
    jobs this process waits for; local: submitit's controller, then the ranks' results once it
    ended)."""
    if sub.site.scheduler == "slurm":
        return _slurm_reading(sub.job_id)
    state = JobState.from_submitit_local(str(sub.job.state))
    if state.final and sub.record is not None and sub.record.cancelled:  # `cancel` stopped its controller
        return slurm.Reading(JobState.CANCELLED)
    return slurm.Reading(state.local_outcome(all(o.ok for o in outcomes(sub))) if state.final else state)


def job_state(sub: Submission) -> JobState:
    return read_state(sub).state


def ranks_ran(sub: Submission) -> int:
    """How many ranks the job's last run had: the spec's world size, or fewer when it ran again
    without a node that died (``hpcdist.login.node_failure_wait``; submitit fixed its task count
    at submission); for a job with spare nodes, its supervisor's last step (``hpcdist.runtime.in_job``)."""
    from hpcdist.scheduler.hostlist import expand_hostlist
    from hpcdist.store.records import node_failures

    res = sub.spec.resources
    if sub.site.scheduler == "slurm" and res.spare_nodes:  # the supervisor's last step, as its line says
        from hpcdist.runtime.in_job_steps import ranks_of_last_step

        task = sub.job.task(0).paths
        return ranks_of_last_step([task.stdout, task.stderr]) or res.world_size
    failures = node_failures.read(sub.paths.node_failures) if sub.site.scheduler == "slurm" else []
    if not failures:
        return res.world_size
    row = slurm.read_state(sub.job_id).row
    nodes = expand_hostlist(row.nodes) if row is not None and row.nodes not in ("", "None assigned") else []
    return len(nodes) * res.tasks_per_node if nodes else res.world_size


def outcomes(sub: Submission, state: JobState = JobState.UNKNOWN, end: Ending | None = None) -> list[TaskOutcome]:
    """One outcome per rank, from submitit's result files (read directly: asking submitit's job
    would call sacct behind the scheduler client's back). A rank without a result is summarised
    by how srun saw it end, or else the first real error line of its log."""
    out = []
    for rank in range(ranks_ran(sub)):
        task = sub.job.task(rank)
        try:
            status, value = load_pickle(task.paths.result_pickle)  # read from the file that was checked
        except FileNotFoundError:
            from hpcdist.login.postmortem import no_result  # only a rank that failed is looked into

            out.append(TaskOutcome(rank, False, error=no_result(task.paths.stderr, state, rank, end, sub.paths)))
            continue
        except Exception as exc:  # half-written, unreadable or untrusted (refused, one line): not a result
            out.append(TaskOutcome(rank, False, error=f"its result file is unreadable: {type(exc).__name__}: {exc}"))
            continue
        if status == "success" and sub.spec.params.get("direct"):  # the function's own return value
            out.append(TaskOutcome(rank, True, summary={"returned": value}))
        elif status == "success":
            out.append(TaskOutcome(rank, True, summary=dict(value or {})))
        else:
            from hpcdist.login.postmortem import first_error_line

            after = f" ({end.after(rank)})" if end and end.after(rank) else ""
            out.append(TaskOutcome(rank, False, error=first_error_line(str(value)) + after, traceback=str(value)))
    return out


def results_in(sub: Submission) -> bool:
    """Every rank of the job's run wrote its result file (a file test, no command)."""
    return all(sub.job.task(rank).paths.result_pickle.exists() for rank in range(ranks_ran(sub)))


def every_rank_returned(sub: Submission) -> bool:
    """A direct ``hpcdist.Executor`` call on Slurm whose every task wrote a successful result:
    done, as submitit's own jobs count it, though Slurm may still say RUNNING or COMPLETING for
    a moment. hpcdist's own jobs wait for Slurm's word (its batch step may still fail after the
    ranks), and so does a task that failed (the cause line reads Slurm's accounting)."""
    if sub.site.scheduler != "slurm" or not sub.spec.params.get("direct"):
        return False
    return results_in(sub) and all(o.ok for o in outcomes(sub, JobState.COMPLETED))


def wait(sub: Submission, poll_s: float = 1.0, timeout_s: float | None = None,
         on_poll: Callable[[JobState], None] | None = None) -> Finished:
    """Block until the scheduler says the job ended; its final state and one outcome per rank.

    Waiting ends on the scheduler's word (squeue, then Slurm's accounting), not on submitit's
    result files, which a job that dies early never writes. A failed job's ``cause`` names the
    rank that failed first, its host, and Slurm's word on the job (``hpcdist.login.postmortem``).
    ``timeout_s=None`` waits as long as the scheduler says the job is not done; a command that
    fails is retried and read as unknown, and only a job proven absent from the queue while
    accounting is down ends the wait with a `SubmitError` (``Vanished``). `on_poll` sees each
    state read (the live status line).
    """
    from hpcdist.login.node_failure_wait import NodeFailures

    vanished = Vanished()
    failures = NodeFailures(sub.job_id, sub.spec, sub.site, sub.paths) if sub.site.scheduler == "slurm" else None

    heard = [-1.0]  # when the newest reading was asked: a kept one is not a second answer

    def ended() -> JobState | None:
        if every_rank_returned(sub):  # a direct call's result is in; Slurm says so after its epilog
            if on_poll is not None:
                on_poll(JobState.COMPLETED)
            return JobState.COMPLETED
        if sub.site.scheduler == "slurm" and sub.job.task(0).paths.result_pickle.exists():
            _SHARED.hurry()  # rank 0 returned: Slurm's word on the end comes next
        reading = read_state(sub)
        state = reading.state
        if failures is not None:  # a requeue after a node failure: exclude the node, or end
            failures.poll(reading.state, reading.row.restarts if reading.row is not None else "")
        if on_poll is not None:
            on_poll(state)
        if state.final:
            return state
        new, heard[0] = reading.asked != heard[0], reading.asked
        if sub.site.scheduler == "slurm" and new and vanished.gone(reading):
            raise SubmitError(Vanished.message(sub.job_id))
        return None

    while True:
        state = poll_until(ended, timeout_s, poll_s, first_s=0.1)  # 0.1, 0.2, 0.4, 0.8, then every poll_s
        if state is None:
            raise SubmitError(
                f"job {sub.job_id} did not finish within {timeout_s:g} s; it is still {job_state(sub).value}"
            )
        after = successor(sub.spec, sub.site, sub.job_id, state)
        if after is None:
            break
        _follow(sub, *after, state)  # its batch node died: its standby job runs it on
        failures = NodeFailures(sub.job_id, sub.spec, sub.site, sub.paths)
        vanished = Vanished()
    if sub.site.scheduler == "slurm" and remote.active():  # `--on HOST`: the job's files as the cluster has them
        remote.fetch([sub.job.paths.folder, sub.paths.progress], [sub.result_path])
    if failures is not None and failures.cause:  # ended by on_node_failure: fail, or the bound
        return Finished(JobState.NODE_FAIL, outcomes(sub, JobState.NODE_FAIL), failures.cause)
    end = _slurm_ending(sub) if sub.site.scheduler == "slurm" and state is not JobState.COMPLETED else None
    if end is not None:  # hpcdist's verdict on the state, and the rank that failed first (not srun's first)
        state, end = end.state(state), end.naming(outcomes(sub, end.state(state), end)).heard(sub.paths)
    done = outcomes(sub, state, end)
    stacks: list[str] = []
    note = ""
    if not (state is JobState.COMPLETED and all(o.ok for o in done)):
        from hpcdist.login.plan import no_gpu_note  # only a job that failed is looked into
        from hpcdist.login.postmortem import timeout_stacks
        from hpcdist.store.records.stackrecord import stack_files

        stacks = timeout_stacks(stack_files(sub.paths, sub.spec.resources.world_size), sub.spec.resources.world_size)
        note = no_gpu_note([f"{o.error}\n{o.traceback}" for o in done if not o.ok], sub.spec, sub.site)
    return Finished(state, done, end.headline() if end else "", tuple(stacks), note)


def _follow(sub: Submission, standby: str, why: str, state: JobState) -> None:
    """`sub` made standby job `standby`'s, which runs its job on (it ended `state`, `why` it goes
    on): waiting, results and logs read the standby's from now on, and the job index has its record."""
    import submitit

    from hpcdist.login import jobindex
    before = sub.job_id
    folder = sub.spec.paths(sub.site, standby).folder
    sub.job = submitit.SlurmJob(folder=folder, job_id=standby, tasks=list(range(sub.spec.resources.world_size)))
    print(f"hpcdist: job {before} ended {state.value}: {why}; its standby job {standby} runs it on from its last "
          f"checkpoint (logs {folder}, result {sub.spec.paths(sub.site, standby).result()})", file=sys.stderr,
          flush=True)
    if sub.record is not None:
        sub.record = standby_record(sub.record, sub.spec, sub.site, standby)
        jobindex.add(sub.record)


def _slurm_ending(sub: Submission) -> Ending:
    """srun's and slurmstepd's lines in the batch log, and Slurm's accounting of the job's steps."""
    from hpcdist.login.exclusions import mark_failed_nodes
    from hpcdist.login.postmortem import accounting, ending  # only a job that failed is looked into

    try:
        batch_log = sub.log_paths[1].read_text(errors="replace")
    except OSError:
        batch_log = ""
    records = accounting(sub.job_id)
    end = ending(batch_log, records)
    marked = mark_failed_nodes(sub.site, sub.job_id, records)
    return dataclasses.replace(end, cause="; ".join(c for c in (end.cause, marked) if c))


# ---------------------------------------------------------------- the status line


def slurm_seconds(text: str) -> float | None:
    """Slurm's ``[D-][HH:]MM:SS`` (squeue %M, sacct Elapsed) in seconds; None if it is not one."""
    days, _, clock = text.strip().rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        day_s = int(days) * 86400 if days else 0
    except ValueError:
        return None
    if not 2 <= len(parts) <= 3:
        return None
    h, m, s = ([0] + parts)[-3:]
    return float(day_s + h * 3600 + m * 60 + s)


def hms(seconds: float | None) -> str:
    """``1:02:03``, ``2-01:02:03`` for more than a day; ``-`` when unknown."""
    if seconds is None or seconds != seconds:
        return "-"
    s = int(max(0.0, seconds))
    days, s = divmod(s, 86400)
    if days:
        return f"{days}-{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# squeue's reasons of a job that a reservation may hold: "ReqNodeNotAvail, Reserved for maintenance"
HELD = re.compile(r"ReqNodeNotAvail|[Rr]eserv")


def reservation_note(reason: str, found: Sequence[Reservation]) -> str:
    """The reservations behind squeue's `reason`, in Slurm's words (name, flags, nodes, end): the
    MAINT ones where it says "Reserved for maintenance", else those active now; "" for none."""
    if not HELD.search(reason):
        return ""
    maint = "maintenance" in reason.lower()
    held = [r for r in found if ("MAINT" in r.flags if maint else r.state == "ACTIVE" or "MAINT" in r.flags)]
    return "; ".join(r.line() for r in held)


class _Watcher:
    """What the status line says at each poll of ``wait``."""

    def __init__(self, sub: Submission, submitted: float, every_s: float) -> None:
        from hpcdist.console import StatusLine

        self.sub, self.submitted = sub, submitted
        self.line = StatusLine(every_s)
        self.folder = sub.paths.progress  # where the node writes
        self.last_state: JobState | None = None
        self.queue: slurm.JobStatus | None = None
        self.queue_read = float("-inf")
        self.held_reason, self.held_note = "", ""

    def __call__(self, state: JobState) -> None:
        from hpcdist.progress import read_progress

        now = time.monotonic()
        if self.sub.site.scheduler == "slurm" and (state is not self.last_state or now - self.queue_read >= 5.0):
            self.queue, self.queue_read = self._slurm_row(state), now
        elapsed: float | None = time.time() - self.submitted
        if self.queue is not None:
            from_slurm = slurm_seconds(self.queue.elapsed)
            elapsed = None if from_slurm is None else from_slurm + (0.0 if state.final else now - self.queue_read)
        words = [f"job {self.sub.job_id} ({self.sub.spec.name}): {state.value} {hms(elapsed)}"]
        detail = ""
        if state is JobState.PENDING and self.queue is not None and self.queue.reason not in ("", "None"):
            detail = f"waiting: {self.queue.reason}" + self._held(self.queue.reason)
        elif state is not JobState.PENDING:
            report = read_progress(self.folder)
            detail = report.text() if report is not None else ""
        line = "  ".join(words + ([detail] if detail else []))
        self.line.show(line, key=f"{state.value}|{detail}", urgent=state is not self.last_state)
        self.last_state = state

    def _held(self, reason: str) -> str:
        """The reservations a pending job waits behind, named once per reason squeue gives."""
        if reason != self.held_reason:
            from hpcdist.scheduler.slurm_cluster import current_reservations

            found = current_reservations() if HELD.search(reason) else None
            self.held_reason, self.held_note = reason, reservation_note(reason, found or [])
        return f"; {self.held_note}" if self.held_note else ""

    def _slurm_row(self, state: JobState) -> slurm.JobStatus | None:
        """squeue's row while the job is queued or runs (reason, elapsed), sacct's once it ended:
        the reading the waiter got, asked no second time."""
        return read_state(self.sub).row


def watch(sub: Submission, submitted: float | None = None, timeout_s: float | None = None,
          every_s: float = 10.0) -> Finished:
    """``wait`` with the status line; `submitted` is when the job went in (elapsed time
    while Slurm has no figure, and on the local site)."""
    watcher = _Watcher(sub, time.time() if submitted is None else submitted, every_s)
    try:
        return wait(sub, timeout_s=timeout_s, on_poll=watcher)
    except KeyboardInterrupt:  # Ctrl-C stops the waiting, not the job (as for a Slurm job's squeue)
        watcher.line.close()
        print(f"stopped waiting; job {sub.job_id} ({sub.spec.name}) goes on: `hpcdist wait {sub.job_id}` follows it "
              f"again, `hpcdist cancel {sub.job_id}` stops it", file=sys.stderr, flush=True)
        raise
    finally:
        watcher.line.close()

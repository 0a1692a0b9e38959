"""A submitted job you can hold: ``JobHandle``, what ``submit`` and ``Executor.submit`` return and
what ``hpcdist.job(ID)`` re-attaches from the job index in any process.

It is the one owner of a job's life after submit: its state (the scheduler client, or on the
local site the controller process and the ranks' results), waiting (the status line of
``submit --wait``), the per-rank outcomes and return values, the log files, and cancelling. The
command line's ``jobs``, ``logs``, ``wait`` and ``cancel`` are thin layers over it
(``hpcdist.login.lifecycle``, ``hpcdist.login.joblogs``).

On the local site a job's id is its controller's process id, which the system reuses: the index
keeps the controller's start time beside it, so a handle never reads another run's process.
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import GenericAlias
from typing import TYPE_CHECKING, Any

from submitit.core.utils import FailedJobError, UncompletedJobError

from hpcdist.errors import JobError, SubmitError
from hpcdist.login.jobindex import JobRecord, find, lookup, mark_ended, write
from hpcdist.polling import poll_until
from hpcdist.scheduler import slurm
from hpcdist.scheduler.local_jobs import controller_alive, group_members, leads_group, signal_group
from hpcdist.scheduler.states import JobState

if TYPE_CHECKING:
    from hpcdist.login.submit import Submission
    from hpcdist.login.watch import Finished, TaskOutcome

CANCEL_GRACE_S = 10.0  # a local job's processes left this long after the cancel are killed (`cancel --grace`)
KILL_WAIT_S = 10.0  # after SIGKILL, for the kernel to end them


@functools.cache
def _attached_local_class() -> Any:
    """submitit's LocalJob for a job started by another process: it runs while the controller
    lives; once gone it ended, cancelled if `hpcdist cancel` says so in the index."""
    from submitit.local.local import LocalJob

    class AttachedLocalJob(LocalJob):
        record: JobRecord

        def get_info(self, mode: str = "force") -> dict[str, str]:
            if self._process is not None:
                return dict(super().get_info(mode))
            if controller_alive(str(self.job_id), self.record.started):
                return {"jobState": "RUNNING"}
            cancelled = find(str(self.job_id), self.record.site).cancelled
            return {"jobState": "INTERRUPTED" if cancelled else "FINISHED"}

    return AttachedLocalJob


def attach(record: JobRecord) -> Submission:
    """A Submission for an indexed job, as ``submit`` returned it."""
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec
    from hpcdist.login.submit import Submission

    tasks = list(range(record.tasks))
    if record.scheduler == "slurm":
        import submitit

        job: Any = submitit.SlurmJob(folder=record.folder, job_id=record.job_id, tasks=tasks)
    else:
        job = _attached_local_class()(folder=record.folder, job_id=record.job_id, tasks=tasks)
        job.record = record
    try:
        spec, site = JobSpec.model_validate(record.spec), Site.model_validate(record.site_model)
    except ValueError as exc:  # pydantic's ValidationError: a record another hpcdist version wrote
        first = str(exc).splitlines()[1:2] or [""]
        raise JobError(f"job {record.job_id}'s record in hpcdist's job index was written by another hpcdist "
                       f"version and does not load in this one ({first[0].strip()}); follow it with that version, "
                       f"or read its files in {record.folder}") from exc
    return Submission(job=job, spec=spec, site=site, script="", record=record)


class JobFailed(JobError, FailedJobError):
    """A job that did not return on every rank: the first failing rank, its host and its error;
    ``traceback`` is that rank's traceback (when it raised), ``outcomes`` every rank's. A
    submitit ``FailedJobError`` too (``except FailedJobError`` catches it); its message is the
    headline, then the traceback, as submitit's carries the task's traceback."""

    def __init__(self, message: str, outcomes: list[TaskOutcome], traceback: str = "") -> None:
        raised = [o for o in outcomes if o.traceback]  # every rank that raised, in rank order (submitit: task 0 first)
        detail = "\n".join(f"rank {o.rank}: {o.traceback.rstrip()}" for o in raised) if len(raised) > 1 else traceback
        super().__init__(f"{message}\n{detail.rstrip()}" if detail else message)
        self.headline, self.outcomes, self.traceback = message, outcomes, traceback


class JobUncompleted(JobFailed, UncompletedJobError):
    """A job that ended with no rank having raised: cancelled, timed out, killed, or a node lost
    (submitit's ``UncompletedJobError``: no output); still a ``JobFailed``, naming the ranks."""


class JobHandle:
    """One submitted job: ``job_id``, ``state``, ``wait()``, ``result()``, ``results()``,
    ``logs(rank)``, ``cancel()``. Made by ``submit`` or re-attached with ``hpcdist.job(ID)``."""

    # ``hpcdist.Job[int]``: a script's annotation of submitit's generic ``Job[int]`` (hpcdist.Job is this class)
    __class_getitem__: classmethod[Any, [Any], GenericAlias] = classmethod(GenericAlias)

    def __init__(self, record: JobRecord, submission: Submission | None = None) -> None:
        self.record = record
        self._submission = submission
        self._finished: Finished | None = None

    def __repr__(self) -> str:
        return f"JobHandle({self.job_id!r}, name={self.record.name!r}, site={self.record.site!r})"

    @classmethod
    def find(cls, job_id: str | int, site: str | None = None) -> JobHandle:
        """The indexed job `job_id`; `site` as `--site` takes it, a name or a site YAML's path."""
        return cls(lookup(str(job_id), site))

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def submission(self) -> Submission:
        if self._submission is None:
            self._submission = attach(self.record)
        return self._submission

    @property
    def num_tasks(self) -> int:
        """The ranks of the job's last run: those submitted, or fewer once it ran again on fewer
        nodes after a node died (``watch.ranks_ran``)."""
        if self.record.scheduler != "slurm":
            return self.record.tasks
        from hpcdist.login.watch import ranks_ran

        return ranks_ran(self.submission)

    @property
    def state(self) -> JobState:
        """The scheduler's word on the job now (a finished job's state does not change)."""
        if self._finished is not None:
            return self._finished.state
        if self.record.ended:
            return JobState(self.record.ended)
        return self.reading().state

    def reading(self) -> slurm.Reading:
        from hpcdist.login.watch import read_state

        return read_state(self.submission)

    def done(self, force_check: bool = False) -> bool:
        """Whether the job ended (submitit's; `force_check` is accepted, every call reads anew)."""
        return self.state.final

    def wait(self, timeout_s: float | None = None, show: bool | None = None) -> Finished:
        """Wait until the job ended; its state and one outcome per rank. `show`: the status line
        of ``submit --wait`` (default: when standard error is a terminal or a notebook)."""
        if self._finished is None:
            from hpcdist.login.watch import wait, watch

            if show is None:
                show = sys.stderr.isatty() or "ipykernel" in sys.modules
            if show:
                finished = watch(self.submission, self.record.submitted, timeout_s=timeout_s)
            else:
                finished = wait(self.submission, timeout_s=timeout_s)
            self._finished = finished
            if self.submission.record is not None and self.submission.record.took_over:  # a standby ran it on
                self.record = self.submission.record
            self.record = mark_ended(self.record, finished.state.value)
        return self._finished

    def outcomes(self) -> list[TaskOutcome]:
        """Every rank's outcome so far (results that are there; the others say why not)."""
        from hpcdist.login.watch import outcomes

        return outcomes(self.submission, self.state)

    def results(self, timeout_s: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order, once the job ended (a task's view: its
        own, alone). A job where a rank raised raises ``JobFailed`` (submitit's ``FailedJobError``)
        naming the first failing rank, its host and its error; one that ended otherwise without
        every result (cancelled, timed out, killed) ``JobUncompleted`` (``UncompletedJobError``)."""
        from hpcdist.login.postmortem import first_failure

        finished = self.wait(timeout_s, show=False)
        failed = [o for o in finished.outcomes if not o.ok]
        if failed or not finished.ok:
            first = first_failure(finished.outcomes)
            host = f" on {first.summary.get('host')}" if first and first.summary.get("host") else ""
            what = f"rank {first.rank}{host}: {first.error}" if first else "every rank returned"
            cause = f"; {finished.cause}" if finished.cause else ""
            raised = any(o.traceback for o in finished.outcomes)
            kind = JobFailed if raised else JobUncompleted
            raise kind(f"job {self.job_id} ({self.record.name}) ended {finished.state.value}: {what}{cause}",
                       finished.outcomes, first.traceback if first else "")
        values = [o.summary.get("returned", o.summary) for o in finished.outcomes]
        return values if self._task is None else [values[self._task]]

    def result(self, timeout_s: float | None = None) -> Any:
        """Rank 0's return value, once the job ended (unlike submitit's ``result()``, which
        refuses a job of several tasks: ``results()`` has every rank's); a task's view: its own."""
        return self.results(timeout_s)[0]

    def exception(self) -> JobFailed | None:
        """submitit's: None once every rank returned, else the error ``result()`` would raise (waits)."""
        try:
            self.results()
        except JobFailed as exc:
            return exc
        return None

    # ------------------------------------------------------------ submitit's Job, beside hpcdist's

    _task: int | None = None  # this handle is one task's view of the job (``task(i)``)

    def task(self, task_id: int) -> JobHandle:
        """One task (rank) of the job, as submitit's ``job.task(i)``; a job of one task is itself."""
        tasks = self.num_tasks
        if not 0 <= task_id < tasks:
            raise ValueError(f"Task id {task_id} must be between 0 and {tasks - 1}")
        if tasks == 1:
            return self
        view = copy.copy(self)
        view._task = task_id
        return view

    @property
    def _job(self) -> Any:
        """submitit's own Job (or a task of it) behind this handle."""
        job = self.submission.job
        return job if self._task is None else job.task(self._task)

    @property
    def paths(self) -> Any:
        """submitit's ``JobPaths`` of the job (a task's: its own): folder, pickles, stdout, stderr."""
        return self._job.paths

    @property
    def _process(self) -> Any:
        """The local controller's process, where this process started it (submitit's LocalJob)."""
        return getattr(self.submission.job, "_process", None)

    def stdout(self) -> str | None:
        """Every task's standard output so far (a task's view: its own), as submitit's; None if none yet."""
        return self._job.stdout()

    def stderr(self) -> str | None:
        """Every task's standard error so far (hpcdist's log lines there too); None if none yet."""
        return self._job.stderr()

    def awaitable(self) -> Any:
        """submitit's asyncio proxy: ``await job.awaitable().result()``, ``results_as_completed()``."""
        from submitit.core.core import AsyncJobProxy

        return AsyncJobProxy(self)  # type: ignore[arg-type]  # it asks done(), result(), results(), task()

    def cancel_at_deletion(self, value: bool = True) -> JobHandle:
        """submitit's: cancel the job when this handle is garbage-collected."""
        self.submission.job.cancel_at_deletion(value)
        return self

    def log_paths(self, rank: int = 0) -> tuple[Path, Path]:
        if not 0 <= rank < self.num_tasks:
            raise SubmitError(f"job {self.job_id} has ranks 0-{self.num_tasks - 1}; rank {rank} is not one of them")
        return self.record.log_paths(rank)

    def logs(self, rank: int = 0) -> str:
        """Rank `rank`'s output so far: its stdout, then its stderr (hpcdist's log lines)."""
        self.log_paths(rank)
        return "".join(path.read_text(errors="replace") for _, path in self.record.rank_files(rank))

    def cancel(self, check: bool = True, grace_s: float = CANCEL_GRACE_S) -> str:
        """Cancel the job (Slurm: scancel); what was done. A local job's controller is asked to
        stop its ranks (SIGINT, submitit's own cancel); whatever of its process group still runs
        `grace_s` later (a rank that ignores the signal, its children, a controller starved of
        CPU) is killed (SIGKILL), so nothing of the job runs on."""
        record = self.record
        if record.scheduler == "slurm" and self.submission.spec.resources.spare_nodes:
            from hpcdist.login.standby import cancel_chain  # the job and the standbys queued behind it

            return cancel_chain(self.submission.spec, self.submission.site, record)
        state = self.state
        if state.final:
            return f"job {record.job_id} ({record.name}) already ended: {state.value}; nothing to cancel"
        if record.scheduler == "slurm":
            slurm.scancel(record.job_id)
            return f"cancelled job {record.job_id} ({record.name}) on site {record.site}"
        self.record = record = replace(record, cancelled=time.time())
        self.submission.record = record  # this handle's own reading says CANCELLED too
        write(record)  # first: whoever waits reads CANCELLED, not FAILED, once it is gone
        pgid = int(record.job_id)
        alive = controller_alive(record.job_id, record.started)
        group = alive and leads_group(record.job_id)
        if alive:
            try:
                os.kill(pgid, signal.SIGINT)  # submitit's own cancel: the controller stops its ranks
            except ProcessLookupError:
                pass
        process = self._process  # this process's child: ended only once reaped (its /proc entry empties first)

        def ended() -> bool | None:
            reaped = process is None or process.poll() is not None
            gone = not group_members(pgid) if group else not controller_alive(record.job_id, record.started)
            return True if reaped and gone else None

        done = f"cancelled job {record.job_id} ({record.name}) on site {record.site}"
        if poll_until(ended, grace_s, 0.2) is not None:
            return done
        if not group:  # an older hpcdist's controller, in its submitter's process group
            raise SubmitError(f"job {record.job_id}'s ranks still run {grace_s:g} s after the cancel; "
                              f"stop them with `kill {record.job_id}`")
        left = group_members(pgid)
        signal_group(pgid, signal.SIGKILL)
        if poll_until(ended, KILL_WAIT_S, 0.1) is None:
            raise SubmitError(f"job {record.job_id}'s processes {left} still run after SIGKILL; see `ps -g {pgid}`")
        return f"{done}; {len(left)} of its processes still ran {grace_s:g} s after the cancel: killed (SIGKILL)"

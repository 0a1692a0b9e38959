"""Many jobs' states read together and kept: what every waiter asks (``hpcdist.login.watch``:
``submit --wait``, ``Executor(...).result()``, ``hpcdist wait``; ``hpcdist jobs``'s table).

A waiter that polls each job on its own costs slurmctld one RPC per job per poll: the load
admins throttle (submitit's issue 1759). Here one ``squeue --me`` answers for every job of the
user at once, and sacct is asked only of those the controller no longer holds (ended over
``MinJobAge`` ago). With backoff, as submitit's ``SlurmInfoWatcher``, the queue is asked again once
half the time since a job was added (or requeued) has passed: 2 s apart at first, at most
``HPCDIST_POLL_MAX_S`` (60 s, as submitit's ``delay_s``) apart, at once after ``hurry`` (a job's ranks
wrote their results).
With a shared file (``hpcdist.scheduler.queue_cache``, in the user's own state folder) an answer
another of her processes got within that time is used instead of asking: twenty ``submit --wait``
at once poll like one. Standard library only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import astuple, fields
from pathlib import Path

from hpcdist.scheduler import queue_cache
from hpcdist.scheduler.slurm import JobStatus, Reading, my_queue, readings_of, squeue_rows
from hpcdist.scheduler.states import JobState

POLL_MIN_S, POLL_MAX_VAR = 2.0, "HPCDIST_POLL_MAX_S"
RAN, REQUEUED = (JobState.RUNNING, JobState.COMPLETING), (JobState.PENDING, JobState.REQUEUED)


class Watcher:
    """Reads the states of many jobs with one squeue and one sacct call. Without `backoff`, an
    answer is kept `ttl_s` (a table, a cancel); with it, the interval above, and `shared` is the
    file her processes share. A final state is kept for as long as the watcher lives."""

    def __init__(self, ttl_s: float = 2.0, backoff: bool = False, shared: Path | None = None) -> None:
        self.ttl_s, self.backoff, self.shared = ttl_s, backoff, shared
        self._read: dict[str, Reading] = {}
        self._since = self._asked = float("-inf")
        self._hurry = False
        self.accounting_error = ""  # the last sacct failure, for a note under a table

    def interval(self, now: float) -> float:
        """How long an answer is kept now."""
        if not self.backoff:
            return self.ttl_s
        top = max(POLL_MIN_S, float(os.environ.get(POLL_MAX_VAR) or 60.0))
        return min(top, max(POLL_MIN_S, (now - self._since) / 2))

    def hurry(self) -> None:
        """Ask at the next read (within a second): a job's ranks wrote their results, its end is near."""
        self._hurry = True

    def queued(self, job_ids: Sequence[str]) -> None:
        """Jobs this process has just queued (sbatch answered): pending, never started, until the
        first poll, which comes after the first interval, as submitit's does, not at once: asking at
        once and then halving from zero cost two polls more than submitit's in a job's first seconds."""
        now = time.monotonic()
        for job_id in job_ids:
            queued = JobStatus(job_id, "", JobState.PENDING.value, "", "0:00", "", restarts="0")
            self._read.setdefault(job_id, Reading(JobState.PENDING, row=queued, asked=now))
        self._since = self._asked = now

    def readings(self, job_ids: Sequence[str]) -> dict[str, Reading]:
        """Each job's reading; the queue asked for those not final once the interval passed (or a
        job is new), so many jobs waited for together cost one query per poll."""
        now = time.monotonic()
        ids = list(dict.fromkeys(job_ids))
        live = [j for j in ids if j not in self._read or not self._read[j].state.final]
        new = [j for j in live if j not in self._read]
        if new:
            self._since = now  # a job added: the polls start over, as submitit's do
        keep = min(1.0, self.interval(now)) if self._hurry else self.interval(now)
        if live and (new or now - self._asked > keep):
            self._hurry, self._asked = False, now
            found, self.accounting_error = readings_of(live, self._queue(live, keep), now)
            for job_id, reading in found.items():
                before = self._read.get(job_id)
                if before is not None and before.state in RAN and reading.state in REQUEUED:
                    self._since = now  # requeued: its waiter acts while it pends (a node failure's exclusion)
                self._read[job_id] = reading
        return {j: self._read[j] for j in job_ids}

    def reading(self, job_id: str) -> Reading:
        return self.readings([job_id])[job_id]

    def _queue(self, job_ids: list[str], keep: float) -> dict[str, JobStatus] | None:
        """The controller's rows: another process's answer from within `keep` that holds every
        job, else asked (the user's whole queue when shared, for the others to use)."""
        if self.shared is None:
            return squeue_rows(job_ids)
        kept = queue_cache.read(self.shared, keep)
        width = len(fields(JobStatus))
        if kept is not None and all(j in kept[1] and len(kept[1][j]) == width for j in job_ids):
            return {j: JobStatus(*row) for j, row in kept[1].items() if len(row) == width}
        at = time.time()
        rows = my_queue()
        if rows is not None:
            queue_cache.write(self.shared, at, {j: list(astuple(r)) for j, r in rows.items()})
        return rows

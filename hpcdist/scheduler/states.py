"""Job states: one enum, mapped once from every word a scheduler uses for them.

Slurm says a job's state in sacct's and squeue's long names (``COMPLETED``, ``CANCELLED by 0``),
squeue's short codes (``CD``, ``CA``), and ``scontrol show job``'s ``JobState=``; submitit's
local executor says ``RUNNING``, ``FINISHED``, ``INTERRUPTED``. Each is read here, into
``JobState`` (TorchX's ``SLURM_STATES -> AppState``), and nowhere else. Standard library only.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """A job's state as hpcdist reasons about it; ``final`` states never change again.

    A string enum: ``job.state == "RUNNING"`` holds, and ``submitit.helpers.monitor_jobs``'s
    ``state.upper()`` works, as with submitit's plain strings. Its values are Slurm's words (which
    submitit's Slurm jobs say too); a local job says them as well (COMPLETED, CANCELLED), not
    submitit's local FINISHED/INTERRUPTED, so code written for one site reads the other alike."""

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
    UNKNOWN = "UNKNOWN"  # the scheduler does not (yet) know the job, could not be asked, or said something else

    @property
    def final(self) -> bool:
        return self in _FINAL_STATES

    @property
    def may_write(self) -> bool:
        """Whether a job in this state may still run or come back and write (a claim's holder)."""
        return not self.final and self is not JobState.UNKNOWN

    @classmethod
    def from_slurm(cls, text: str) -> JobState:
        """sacct's, squeue's or scontrol's word (``CANCELLED by 0``, ``CA``, ``COMPLETING``)."""
        word = text.strip().split(" ")[0].rstrip("+").upper()
        return _SLURM_STATES.get(word, cls.UNKNOWN)

    @classmethod
    def from_submitit_local(cls, text: str) -> JobState:
        """submitit's LocalJob states (FINISHED, INTERRUPTED, ...). FINISHED means the local
        controller ended, whatever its ranks did: ``local_outcome`` decides what it ended as."""
        return _LOCAL_STATES.get(text.strip().upper(), cls.UNKNOWN)

    def local_outcome(self, every_rank_succeeded: bool) -> JobState:
        """A local job's state once its ranks' results are read: the controller's FINISHED is
        COMPLETED only when every rank returned a result, FAILED otherwise."""
        if self is JobState.COMPLETED and not every_rank_succeeded:
            return JobState.FAILED
        return self


_FINAL_STATES = frozenset({
    JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED, JobState.OUT_OF_MEMORY,
    JobState.NODE_FAIL, JobState.PREEMPTED, JobState.BOOT_FAIL, JobState.DEADLINE,
})
# Slurm's long names (sacct, squeue %T, scontrol) and short codes (squeue %t) for every state it reports.
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

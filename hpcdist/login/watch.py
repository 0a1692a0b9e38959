"""The status line of a job being waited for: its state, elapsed time, why it is pending, and
rank 0's newest progress; in place on a terminal, a line per change (at most every 10 s) in a
pipe or a log. ``submit --wait``, ``hpcdist wait`` and ``JobHandle.wait`` show it.
"""

from __future__ import annotations

import time

from hpcdist.login import submit as sub_
from hpcdist.login.submit import Finished, Submission
from hpcdist.scheduler import slurm
from hpcdist.scheduler.states import JobState


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


class _Watcher:
    """What the status line says at each poll of ``submit.wait``."""

    def __init__(self, sub: Submission, submitted: float, every_s: float) -> None:
        from hpcdist.console import StatusLine

        self.sub, self.submitted = sub, submitted
        self.line = StatusLine(every_s)
        self.folder = sub.paths.progress  # where the node writes
        self.last_state: JobState | None = None
        self.queue: slurm.JobStatus | None = None
        self.queue_read = float("-inf")

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
            detail = f"waiting: {self.queue.reason}"
        elif state is not JobState.PENDING:
            report = read_progress(self.folder)
            detail = report.text() if report is not None else ""
        line = "  ".join(words + ([detail] if detail else []))
        self.line.show(line, key=f"{state.value}|{detail}", urgent=state is not self.last_state)
        self.last_state = state

    def _slurm_row(self, state: JobState) -> slurm.JobStatus | None:
        """squeue's row while the job is queued or runs (reason, elapsed), sacct's once it ended."""
        return slurm.read_state(self.sub.job_id).row


def watch(sub: Submission, submitted: float | None = None, timeout_s: float | None = None,
          every_s: float = 10.0) -> Finished:
    """``submit.wait`` with the status line; `submitted` is when the job went in (elapsed time
    while Slurm has no figure, and on the local site)."""
    watcher = _Watcher(sub, time.time() if submitted is None else submitted, every_s)
    try:
        return sub_.wait(sub, timeout_s=timeout_s, on_poll=watcher)
    finally:
        watcher.line.close()

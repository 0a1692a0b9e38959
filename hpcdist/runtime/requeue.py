"""Requeue a preempted or timed-out job through submitit's own mechanism.

submitit installs a handler for its preemption signal that requeues at once; a training job
replaces it with a flag (``hpcdist.api.Context.should_stop``), checkpoints at the next step
boundary on every rank, and only then asks submitit's job environment to requeue: ``scontrol requeue <job id>`` on
Slurm, exit code 144 (``LOCAL_REQUEUE_RETURN_CODE``) on the local site, whose controller then
restarts the ranks. A requeued job has written no result, so it is never taken as finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger("hpcdist")

# How close to the time limit a preemption signal must come to count as a time-out: Slurm sends
# `--signal=SIG@N` up to a minute late, and a rank needs a moment to notice.
TIMEOUT_SLACK_S = 60.0


class Requeued(SystemExit):
    """Raised on every rank once the job is requeued: the process ends without a result."""


def classify(now: float, launch_time: float, limit_s: float, seconds_before_end: float) -> str:
    """``timeout`` if the signal came within the warning time of the job's limit, else ``preemption``."""
    left = launch_time + limit_s - now
    return "timeout" if left <= seconds_before_end + TIMEOUT_SLACK_S else "preemption"


def submitit_requeue(rendezvous_file: Path | None, env: Mapping[str, str]) -> Callable[[], None] | None:
    """A `JobContext.requeue` for jobs that submitit started (as `env` says), or None outside submitit."""
    executor = env.get("SUBMITIT_EXECUTOR", "")
    if executor not in ("slurm", "local"):
        return None

    def requeue() -> None:
        from submitit.core.job_environment import JobEnvironment

        if rendezvous_file is not None:
            # The local controller restarts ranks under the same job id: a stale address file
            # would send them to a dead store. (Slurm requeues get a new key from the restart count.)
            rendezvous_file.unlink(missing_ok=True)
        env = JobEnvironment()
        log.warning("requeueing job %s through submitit (%s)", env.job_id, executor)
        for handler in logging.getLogger("hpcdist").handlers:
            handler.flush()
        env._requeue(0)  # Slurm: scontrol requeue; local: sys.exit(144) (the controller restarts us)

    return requeue

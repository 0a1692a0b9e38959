"""Names shared by the job script (render side) and the ranks (runtime side)."""

from __future__ import annotations

import re
from collections.abc import Mapping

LAUNCH_TIME_VAR = "HPCDIST_LAUNCH_TIME"  # epoch seconds, exported just before the launcher runs
FAULT_EXIT_VAR = "HPCDIST_FAULT_EXIT_RANK"  # for fault tests: this rank exits before joining
LAUNCH_ID_VAR = "HPCDIST_LAUNCH_ID"  # unique per start of the ranks where no scheduler numbers it (local site)
RESTART_COUNT_VAR = "SLURM_RESTART_COUNT"  # Slurm: how often this job was requeued (absent: never)
LOCAL_RESTARTS_VAR = "HPCDIST_LOCAL_RESTART_COUNT"  # local site: how often the controller restarted the ranks
# a job with spare nodes (hpcdist.runtime.in_job): how often its supervisor started the ranks again in
# the same allocation, and the supervisor's address, which each rank connects to (its sign of life)
IN_JOB_RESTART_VAR = "HPCDIST_IN_JOB_RESTART"
SUPERVISOR_VAR = "HPCDIST_SUPERVISOR"
# a rank started again alone while the others go on in their processes (in-place restart): the ranks it
# takes ("2" or "2,3", one per task of its step), the world size, the ranks' nodes and tasks per node
IN_PLACE_VAR = "HPCDIST_IN_PLACE"
RERUN_VAR = "HPCDIST_RERUN_IN_PROCESS"  # how often this process ran the job before (on_rank_failure: in_place)
KEEP_STATE_VAR = "HPCDIST_KEEP_STATE"  # "1": ranks keep their last checkpoint in memory (on_rank_failure: in_place)
# for fault tests on CPU: gloo made to end a rank as NCCL's watchdog does (hpcdist.runtime.abort):
# its collectives never raise, and the rank aborts (SIGABRT) this many seconds after the timeout
IMITATE_ABORT_VAR = "HPCDIST_TEST_ABORT_AFTER_S"
CALL_JOB_VAR = "HPCDIST_CALL_JOB"  # a direct Executor call's spec and site (a 0600 JSON file), read on its node
# hpcdist's own line in the batch log when a requeued run ends before its ranks start
# (hpcdist.runtime.node_failure writes it, hpcdist.login.postmortem reads it)
STOPPED = "hpcdist: not run again: "
# A rank whose collective hung ends itself with this status once its summary is written and NCCL's
# watchdog did not end it (hpcdist.runtime.abort): the in-job supervisor takes it for a hang, not
# for an error of the job's code, and starts the rank again as it would a killed one.
HUNG_EXIT = 124
LOCAL_AFTER_VAR = "HPCDIST_LOCAL_AFTER"  # local site: "PID:START" of a job to wait for first (map_array's max_parallel)


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm (or the local site's controller) has requeued this job (0 on its first
    start, and outside a job)."""
    try:
        return max(0, int(env.get(RESTART_COUNT_VAR) or env.get(LOCAL_RESTARTS_VAR) or 0))
    except ValueError:
        return 0


def in_job_restarts(env: Mapping[str, str]) -> int:
    """How often a job's supervisor started its ranks again in the same allocation (0 outside one)."""
    try:
        return max(0, int(env.get(IN_JOB_RESTART_VAR) or 0))
    except ValueError:
        return 0


def array_task_id(env: Mapping[str, str]) -> str | None:
    """A Slurm array task's id as submitit and sacct name it (``ARRAYID_INDEX``); None outside an array."""
    array, index = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"{array}_{index}" if array and index else None


# A rank that fails after another rank's code failed (its connections to it broke, or the watchdog
# stopped it) says so in its error; the login side names the rank that failed first instead.
_WHO = re.compile(r"rank \d+ on [^\s:]+")
_AFTER_FIRST = re.compile(r"\(after rank \d+ on [^\s:]+ failed first\)")


def after_first(reason: str) -> str:
    """``(after rank 2 on n2 failed first)`` for the failure `reason` another rank posted
    (it begins with ``rank N on HOST``); "" when it names no rank."""
    who = _WHO.match(reason)
    return f"(after {who.group(0)} failed first)" if who else ""


def is_after_first(error: str) -> bool:
    """Whether a rank's error says it failed after another rank had failed first."""
    return _AFTER_FIRST.search(error) is not None

"""Names shared by the job script (render side) and the ranks (runtime side)."""

from __future__ import annotations

from collections.abc import Mapping

LAUNCH_TIME_VAR = "HPCDIST_LAUNCH_TIME"  # epoch seconds, exported just before the launcher runs
FAULT_EXIT_VAR = "HPCDIST_FAULT_EXIT_RANK"  # for fault tests: this rank exits before joining
LAUNCH_ID_VAR = "HPCDIST_LAUNCH_ID"  # unique per start of the ranks where no scheduler numbers it (local site)
RESTART_COUNT_VAR = "SLURM_RESTART_COUNT"  # Slurm: how often this job was requeued (absent: never)
LOCAL_RESTARTS_VAR = "HPCDIST_LOCAL_RESTART_COUNT"  # local site: how often the controller restarted the ranks


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm (or the local site's controller) has requeued this job (0 on its first
    start, and outside a job)."""
    try:
        return max(0, int(env.get(RESTART_COUNT_VAR) or env.get(LOCAL_RESTARTS_VAR) or 0))
    except ValueError:
        return 0

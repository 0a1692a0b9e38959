"""Names shared by the job script (render side) and the ranks (runtime side)."""

LAUNCH_TIME_VAR = "HPCDIST_LAUNCH_TIME"  # epoch seconds, exported just before the launcher runs
FAULT_EXIT_VAR = "HPCDIST_FAULT_EXIT_RANK"  # for fault tests: this rank exits before joining
LAUNCH_ID_VAR = "HPCDIST_LAUNCH_ID"  # unique per start of the ranks where no scheduler numbers it (local site)
LOCAL_RESTARTS_VAR = "HPCDIST_LOCAL_RESTART_COUNT"  # local site: how often the controller restarted the ranks

"""The local site's scheduler: submitit's local controller, one process per job on this machine.

A local job's id is its controller's process id, which the system reuses; the controller's
start time (``/proc/PID/stat``) tells it from a later process that got the same id.
Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

LOCAL_CONTROLLER = "hpcdist.runtime.local_controller"


def process_started(pid: str) -> int | None:
    """The start time of process `pid` in clock ticks since boot (``/proc/PID/stat`` field 22);
    None when no such process runs (or it is a zombie), or there is no procfs."""
    try:
        stat = (Path("/proc") / pid / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 and fields[0] != "Z" else None


def controller_alive(pid: str, started: int | None = None) -> bool:
    """Whether the local controller `pid` still runs: hpcdist's (``LOCAL_CONTROLLER``), or
    submitit's own for a job of an older hpcdist; when `started` is known, that very process."""
    if not Path("/proc/self").is_dir():  # no procfs (macOS): any live process of that id
        try:
            os.kill(int(pid), 0)
        except (OSError, ValueError):
            return False
        return True
    now = process_started(pid)
    if now is None or (started is not None and now != started):
        return False
    try:
        cmdline = (Path("/proc") / pid / "cmdline").read_bytes()
    except OSError:
        return False
    return any(name in cmdline for name in (LOCAL_CONTROLLER.encode(), b"submitit.local._local"))

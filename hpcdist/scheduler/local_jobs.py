"""The local site's jobs as processes of this machine: one controller process per job
(``hpcdist.runtime.local_controller``, submitit's, started by ``login.submit``), seen from outside.

A local job's id is its controller's process id, which the system reuses; the controller's
start time (``/proc/PID/stat``) tells it from a later process that got the same id. The controller
leads a process group of its own (the job id), which its ranks and their children join: a cancel
ends that whole group (``group_alive``, ``signal_group``). The job's GPUs
are this machine's, as ``nvidia-smi -L`` lists them within the submitting shell's
``CUDA_VISIBLE_DEVICES`` (``machine_gpus``). Standard library only.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

LOCAL_CONTROLLER = "hpcdist.runtime.local_controller"


def _stat(pid: str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (state first, then the parent,
    the process group, ...); [] when no such process, or no procfs."""
    try:
        stat = (Path("/proc") / pid / "stat").read_text()
    except OSError:
        return []
    return stat.rsplit(")", 1)[-1].split()


def process_started(pid: str) -> int | None:
    """The start time of process `pid` in clock ticks since boot (``/proc/PID/stat`` field 22);
    None when no such process runs (or it is a zombie), or there is no procfs."""
    fields = _stat(pid)
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



def group_members(pgid: int) -> list[int]:
    """The live processes (not zombies) of process group `pgid`; with no procfs, [pgid] while
    the group answers a signal 0."""
    proc = Path("/proc")
    if not (proc / "self").is_dir():
        try:
            os.killpg(pgid, 0)
        except OSError:
            return []
        return [pgid]
    out = []
    for entry in proc.iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else []
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or cgroup narrows): the
    local site's node, as ``machine_gpus`` gives its GPUs."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def leads_group(pid: str) -> bool:
    """Whether process `pid` leads its own process group: a controller this hpcdist started,
    which a cancel may end group and all (an older hpcdist's shared the submitter's group)."""
    try:
        return os.getpgid(int(pid)) == int(pid)
    except (OSError, ValueError):
        return False


def signal_group(pgid: int, sig: int) -> None:
    """`sig` to every process of group `pgid`; nothing if the group is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


_GPU_LINE = re.compile(r"GPU (?P<index>\d+): .*\(UUID: (?P<uuid>[^)]+)\)")


@functools.cache
def _listed_gpus() -> tuple[tuple[str, str], ...]:
    """(index, UUID) of each GPU ``nvidia-smi -L`` lists; () without nvidia-smi (no NVIDIA driver)
    or when it fails. submitit's LocalExecutor counts with torch, a second's import at every submit;
    nvidia-smi answers in tens of milliseconds, and only for a job that asks for GPUs."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple((m["index"], m["uuid"]) for line in out.splitlines() if (m := _GPU_LINE.match(line.strip())))


def machine_gpus(env: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs a local job may have, as ``CUDA_VISIBLE_DEVICES`` names them: the entries of the
    shell's own ``CUDA_VISIBLE_DEVICES`` (an index or a UUID, or its prefix, as CUDA takes them)
    up to the first that names no listed GPU, where CUDA stops too; every listed GPU by index
    when the variable is unset."""
    listed = _listed_gpus()
    if "CUDA_VISIBLE_DEVICES" not in env:
        return tuple(index for index, _ in listed)
    seen: list[str] = []
    for entry in (e.strip() for e in env["CUDA_VISIBLE_DEVICES"].split(",")):
        if not any(entry == index or (len(entry) > 4 and uuid.startswith(entry)) for index, uuid in listed):
            break
        seen.append(entry)
    return tuple(seen)

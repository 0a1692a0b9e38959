"""The user's queue as one process last read it, for her other processes: a file in her own state
folder (``hpcdist.login.watch`` names it), so that twenty ``hpcdist submit --wait`` at once cost
slurmctld one ``squeue`` per poll, not twenty.

One JSON file per cluster reached (scontrol's path, ``SLURM_CONF`` and the login node), written
to a temporary name and renamed (a reader never sees half of one), 0600 in a 0700 folder: it is
read only from a folder no one else may write. Each row is the fields of
``hpcdist.scheduler.slurm.JobStatus``; what cannot be read is no answer, never an empty queue.
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path


def cluster_key(login: str = "") -> str:
    """Which cluster this process's commands reach, as a file name's part: scontrol's path,
    ``SLURM_CONF`` and the login node (the test bed runs several clusters from one account)."""
    reach = "|".join([shutil.which("scontrol") or "", os.environ.get("SLURM_CONF", ""), login])
    return hashlib.sha1(reach.encode()).hexdigest()[:12]


def path_in(folder: Path, login: str = "", what: str = "queue") -> Path:
    """The file in `folder` of `what` (``queue``, ``reservations``) of the cluster this process's commands reach."""
    return folder / f"{what}-{cluster_key(login)}.json"


def read(path: Path, max_age_s: float) -> tuple[float, dict[str, list[str]]] | None:
    """(when it was asked, wall clock; each job's row) of an answer younger than `max_age_s`;
    None for none, an older one, or one that cannot be read."""
    try:
        if time.time() - path.stat().st_mtime >= max_age_s:
            return None
        data = json.loads(path.read_text())
        at, rows = float(data["at"]), data["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if time.time() - at >= max_age_s or not isinstance(rows, dict):
        return None
    return at, {str(k): [str(v) for v in row] for k, row in rows.items() if isinstance(row, list)}


def write(path: Path, at: float, rows: dict[str, list[str]]) -> None:
    """The answer asked at `at` (wall clock); a failure only leaves the others to ask themselves."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # her state folder, as the job index makes it
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"at": at, "rows": rows}, f)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)

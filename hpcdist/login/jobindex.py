"""The index of submitted jobs: what lets `logs`, `jobs`, `wait` and `cancel` work from a job id.

One JSON file per job, ``<state>/jobs/<site>/<job id>.json``, written atomically (temporary
name, fsync, ``os.replace``): two submits at once write two different files, so they never race,
and a reader never sees half a record. Plain files rather than SQLite because a home directory
on a cluster is often NFS, where SQLite's locking is not dependable. The state folder is
``$HPCDIST_STATE``, else ``$XDG_STATE_HOME/hpcdist``, else ``~/.local/state/hpcdist``; it is
private to the user (mode 0700, files 0600), as a record holds the job's spec and site.

Paths in a record are absolute, so a job is found from any folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hpcdist.errors import SubmitError

STATE_VAR = "HPCDIST_STATE"
_SAFE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def state_dir(env: dict[str, str] | None = None) -> Path:
    """The user's hpcdist state folder (not created here)."""
    env = dict(os.environ) if env is None else env
    if env.get(STATE_VAR):
        return Path(env[STATE_VAR]).expanduser()
    base = Path(env["XDG_STATE_HOME"]).expanduser() if env.get("XDG_STATE_HOME") else Path.home() / ".local" / "state"
    return base / "hpcdist"


def jobs_dir() -> Path:
    return state_dir() / "jobs"


@dataclass(frozen=True)
class JobRecord:
    """One submitted job as hpcdist knows it; `spec` and `site` are the validated models as JSON
    data, so `wait` re-attaches without reading any YAML again."""

    job_id: str
    site: str
    scheduler: str
    name: str
    kind: str
    spec_path: str  # the YAML as the user named it, or "command line"
    submitted: float  # epoch seconds
    host: str  # where it was submitted from
    tasks: int
    nodes: int
    folder: str  # the job's log folder: submitit's files, rank logs, progress.json
    stdout: str  # rank stdout/stderr log paths, "%t" standing for the rank
    stderr: str
    result: str
    checkpoints: str
    spec: dict[str, Any]
    site_model: dict[str, Any]
    cancelled: float | None = None  # when `hpcdist cancel` cancelled it (the local site has no accounting)
    started: int | None = None  # local site: the controller's start time (``scheduler.local_jobs``), as pids are reused
    ended: str | None = None  # the final state, once a waiter learnt it (kept when the results are deleted)
    took_over: str | None = None  # a standby job: the job whose run it goes on with (hpcdist.runtime.standby)

    def log_paths(self, rank: int) -> tuple[Path, Path]:
        """Rank `rank`'s stdout and stderr files."""
        return Path(self.stdout.replace("%t", str(rank))), Path(self.stderr.replace("%t", str(rank)))

    def rank_files(self, rank: int) -> list[tuple[str, Path]]:
        """(label, path) of rank `rank`'s logs that exist now, stdout first; where the launcher
        wrote no per-rank files (mpirun), hpcdist's own rank logs (``train_rank1.log``)."""
        out, err = self.log_paths(rank)
        files = [(f"rank {rank} stdout", out), (f"rank {rank} stderr", err)]
        found = [(label, p) for label, p in files if p.is_file()]
        if found:
            return found
        return [(f"rank {rank} hpcdist log", p) for p in sorted(Path(self.folder).glob(f"*_rank{rank}.log"))]


def _check_name(value: str, what: str) -> str:
    if not _SAFE.fullmatch(value):
        raise SubmitError(f"{what} {value!r} cannot name a file in the job index (letters, digits, '_', '.', '-')")
    return value


def _path(site: str, job_id: str) -> Path:
    return jobs_dir() / _check_name(site, "site name") / f"{_check_name(job_id, 'job id')}.json"


def write(record: JobRecord) -> Path:
    """Write `record` (new, or replacing the job's earlier record) atomically."""
    from hpcdist.files.atomic import atomic_path  # the one atomic writer; imported only to write

    path = _path(record.site, record.job_id)
    for folder in (state_dir(), jobs_dir(), path.parent):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f, indent=1)
    return path


KEEP_RECORDS = 1000  # the index keeps this many jobs per site, the newest
KEEP_DAYS = 60.0  # and forgets ended jobs older than this


def add(record: JobRecord) -> JobRecord | None:
    """Record a submitted job, and forget the oldest ones past the index's bounds. The job is in
    the queue already, so a failure to record it is a warning on stderr, not an error."""
    try:
        write(record)
    except (OSError, SubmitError) as exc:
        print(f"hpcdist: warning: job {record.job_id} is submitted but not in the job index ({exc}); "
              f"`hpcdist logs/wait/cancel {record.job_id}` will not find it", file=sys.stderr)
        return None
    if _prune_due(record.site):
        prune(record.site)
    return record


PRUNE_EVERY_S = 3600.0  # reading every record at each submit made a busy index cost 50 ms a submit


def _prune_due(site: str, keep: int = KEEP_RECORDS) -> bool:
    """Whether the site's part of the index is a tenth over its count (a directory listing, no
    record read: a full index is not read again at every submit), or was last pruned over
    PRUNE_EVERY_S ago (``.pruned``'s time)."""
    folder = _path(site, "x").parent
    try:
        count = sum(1 for e in os.scandir(folder) if e.name.endswith(".json") and not e.name.startswith("."))
        last = (folder / ".pruned").stat().st_mtime
    except OSError:
        return True
    return count > keep + max(10, keep // 10) or time.time() - last > PRUNE_EVERY_S


def prune(site: str, keep: int = KEEP_RECORDS, keep_days: float = KEEP_DAYS) -> list[str]:
    """Forget a site's jobs beyond the newest `keep`, and ended ones older than `keep_days`;
    the ids forgotten."""
    recs = [r for r in records() if r.site == site]
    old = time.time() - keep_days * 86400
    gone = recs[:-keep] if len(recs) > keep else []
    gone += [r for r in recs[-keep:] if r.ended and r.submitted < old]
    for r in gone:
        _path(r.site, r.job_id).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        _path(site, "x").parent.joinpath(".pruned").touch()
    return [r.job_id for r in gone]


def mark_ended(record: JobRecord, state: str) -> JobRecord:
    """The record again, with its final state kept (best effort: a waiter's knowledge)."""
    if record.ended == state:
        return record
    record = replace(record, ended=state)
    try:
        write(record)
    except OSError:
        pass
    return record


def mark_cancelled(record: JobRecord) -> JobRecord:
    """The record again, marked cancelled now."""
    record = replace(record, cancelled=time.time())
    write(record)
    return record


def _read(path: Path) -> JobRecord | None:
    try:
        return JobRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # a record from another hpcdist version, or not a record


def records() -> list[JobRecord]:
    """Every job in the index, oldest first."""
    found = [_read(p) for p in jobs_dir().glob("*/*.json") if not p.name.startswith(".")]
    return sorted((r for r in found if r is not None), key=lambda r: r.submitted)


def _slurm_owner(job_id: str) -> str:
    """Another user's name when Slurm knows job `job_id` as theirs; "" otherwise (or no Slurm here)."""
    from hpcdist.files.trust import current_user
    from hpcdist.scheduler import slurm

    if not slurm.is_job_id(job_id) or shutil.which("scontrol") is None:
        return ""
    info = slurm.show_job(job_id)
    return info.user if info is not None and info.user and info.user != current_user() else ""


def lookup(job_id: str, site: str | None = None) -> JobRecord:
    """The job a user names on the command line or to ``hpcdist.job``: `site` is what `--site`
    takes, a site's name or its YAML's path, found under the name `submit` recorded
    (``hpcdist.config.site_name``), so the same `--site` finds the job in every command."""
    from hpcdist.config import site_name

    return find(job_id, None if site is None else site_name(site))


def find(job_id: str, site: str | None = None) -> JobRecord:
    """The job `job_id` (on the site recorded as `site`, when given: ``JobRecord.site``; a user's
    `--site` goes through ``lookup``); one clear error when the index has none, or more than one
    site has a job of that id."""
    _check_name(job_id, "job id")
    if site is not None:
        paths = [_path(site, job_id)]
    else:
        paths = sorted(jobs_dir().glob(f"*/{job_id}.json"))
    found = [r for r in (_read(p) for p in paths if p.is_file()) if r is not None]
    if not found:
        where = f" on site {site!r}" if site else ""
        owner = _slurm_owner(job_id)
        if owner:
            raise SubmitError(
                f"job {job_id} is {owner}'s, not yours: hpcdist's job index ({jobs_dir()}) holds only your own "
                f"jobs, and their logs, stacks and cancel are {owner}'s to ask for (or an admin's)"
            )
        raise SubmitError(
            f"no job {job_id}{where} in the job index ({jobs_dir()}); `hpcdist jobs` lists the jobs submitted from here"
        )
    if len(found) > 1:
        sites = ", ".join(r.site for r in found)
        raise SubmitError(f"job id {job_id} is in the index for sites {sites}; name one with --site")
    return found[0]

"""The site's node health record: which node was found bad, why, when, and by which job.

A preflight that finds a slow or unreachable node, and a job that ends naming a dead node, mark
it here; every later submission excludes the nodes marked within the site's
``health.exclude_for_h``, and ``hpcdist nodes`` lists and clears the marks. The record lives on
the site's shared storage (``hpcdist.config.paths.node_health``), written by the jobs and login
shells of every user of the site at once, so each mark is its own small JSON file written with
the store's atomic write (``hpcdist.store.atomic``): two writers never touch the same file, none
is lost and a reader never finds one half-written. Files are 0664 and the folder 0775, readable
(and clearable) by the group; a mark holds a node name, a reason, a time, a job id and who wrote
it, nothing secret. A mark older than ``KEEP_S`` is removed by the next writer; a reader
ignores marks older than what it asks for. Both sides import this module (the nodes mark from
the preflight, the login node from the post-mortem and the ``nodes`` command).
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

from hpcdist.config.paths import node_health
from hpcdist.config.site import Site, Storage
from hpcdist.errors import ConfigError
from hpcdist.store.atomic import atomic_path, is_temporary, make_folders

Source = Literal["preflight", "node_failure", "timeout", "user"]
SOURCES: tuple[str, ...] = get_args(Source)
FILE_MODE, FOLDER_MODE = 0o664, 0o775
KEEP_S = 30 * 24 * 3600.0  # a mark older than this is removed by the next writer
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SUFFIX = ".mark.json"
MAX_MARK_BYTES = 16384  # a mark is a few hundred bytes; anything bigger is not one


def _warn(message: str, *args: object) -> None:
    """A skipped mark, on the "hpcdist" logger; logging loads here, not with the module: every
    Slurm ``render`` reads the record, and hardly ever finds a file to skip."""
    import logging

    logging.getLogger("hpcdist").warning(message, *args)


@dataclass(frozen=True)
class Mark:
    """One node found bad once: by whom (`source`, `job_id`, `user`, `host`), when and why."""

    node: str
    reason: str
    when: float  # seconds since the epoch
    job_id: str
    source: str
    user: str = ""
    host: str = ""

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.when)

    def describe(self) -> str:
        """``n2: preflight, job 812, 2026-11-24 02:40 UTC: all_reduce busbw 0.1 GB/s below ...``"""
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.when))
        job = f", job {self.job_id}" if self.job_id else ""
        return f"{self.node}: {self.source}{job}, {stamp}: {self.reason}"


Where = Site | Storage | Path


def _storage(where: Where) -> Storage | None:
    return where.storage if isinstance(where, Site) else where if isinstance(where, Storage) else None


def folder(where: Where) -> Path:
    """The record's folder: a site's or storage's ``node_health`` path, or a folder given as is."""
    storage = _storage(where)
    return Path(str(where)) if storage is None else node_health(storage)


def check_node(node: str) -> str:
    if not _NODE.fullmatch(node):
        raise ConfigError(
            f"{node!r} is not a node name: one host name as Slurm lists it (letters, digits, '.', '_', '-'), e.g. n3"
        )
    return node


def _one_line(text: str, limit: int = 400) -> str:
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _make_folder(path: Path, storage: Storage | None) -> None:
    """The record's folder, 0775 (the group marks and clears); a missing scratch root above it is
    made as the site's ``storage.mode`` says, not as the marking shell's umask would leave it."""
    if path.is_dir():
        return
    if storage is not None:
        make_folders(path.parent, storage.folder_mode)
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(path, FOLDER_MODE)  # the umask may have taken the group's bits
    except PermissionError:
        pass  # made at the same moment by another user, who owns it


def mark(where: Where, node: str, reason: str, job_id: str = "", source: Source = "user") -> Mark:
    """Record `node` as bad for `reason`, found by `source` in job `job_id`; its own new file
    (none when that job already marked that node from that source: the mark it made is returned).

    Raises ConfigError for a node name or source hpcdist cannot record, OSError when the shared
    storage cannot be written (a caller on a failure path reports that and goes on).
    """
    check_node(node)
    if source not in SOURCES:
        raise ConfigError(f"mark source {source!r} is not one of {', '.join(SOURCES)}")
    if job_id:  # once per node, job and source: the ranks of one job, or two waiters, do not repeat it
        for m in map(_read, _files(folder(where), node)):
            if m is not None and (m.node, m.job_id, m.source) == (node, job_id, source):
                return m
    from hpcdist.store.trust import current_user

    user = current_user()  # a reader takes the author from the file's owner anyway
    entry = Mark(node, _one_line(reason), time.time(), _one_line(job_id, 40), source, user, socket.gethostname())
    path = folder(where)
    _make_folder(path, _storage(where))
    name = f"{node}.{time.time_ns()}-{os.getpid()}-{uuid.uuid4().hex[:8]}{_SUFFIX}"
    with atomic_path(path / name, mode=FILE_MODE) as tmp:
        with open(tmp, "w") as fh:
            json.dump(asdict(entry), fh)
    prune(path, KEEP_S)
    return entry


def _read(path: Path) -> Mark | None:
    """A mark as its writer made it, or None: removed meanwhile, or not a mark hpcdist wrote (the
    folder is the group's: a file put there by hand is checked like a mark being made, so no
    newline reaches a job script and no odd node name reaches ``--exclude``)."""
    try:
        raw, owner = _read_plain(path)
        data = json.loads(raw)
        m = Mark(str(data["node"]), _one_line(str(data["reason"])), float(data["when"]),
                 _one_line(str(data["job_id"]), 40), str(data["source"]), owner,
                 _one_line(str(data["host"]), 128))
    except _Skipped as exc:
        _warn("node health: skipped %s", exc)
        return None
    except OSError:  # removed meanwhile
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        _warn("node health: skipped %s: not a mark hpcdist wrote (%s)", path, type(exc).__name__)
        return None
    return m if _NODE.fullmatch(m.node) and m.source in SOURCES else None


class _Skipped(Exception):
    """An entry of the group's folder that is no mark: a link, a FIFO, a device, a huge file."""


def _read_plain(path: Path) -> tuple[bytes, str]:
    """A mark file's bytes and its author (the file's owner, not what the file says), read without
    following a link or waiting on a FIFO (O_NOFOLLOW | O_NONBLOCK, then fstat)."""
    from hpcdist.store.trust import describe, opened_plain, owner_name

    try:
        with opened_plain(path) as (fd, st):
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MARK_BYTES:
                raise _Skipped(f"{describe(path, st)}: not a regular file of at most {MAX_MARK_BYTES} bytes")
            return os.read(fd, MAX_MARK_BYTES + 1), owner_name(st.st_uid)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Skipped(f"{path}: a symbolic link, not a mark") from exc
        raise


def _files(path: Path, node: str = "") -> list[Path]:
    """The committed mark files (of `node`'s name prefix, when given: read them to be sure)."""
    try:
        return [p for p in path.iterdir()
                if p.name.endswith(_SUFFIX) and not is_temporary(p) and p.name.startswith(f"{node}." if node else "")]
    except FileNotFoundError:
        return []


def marks(where: Where, within_s: float | None = None) -> list[Mark]:
    """Every mark (of the last `within_s` seconds, when given), oldest first."""
    now = time.time()
    found = [m for m in map(_read, _files(folder(where))) if m is not None]
    if within_s is not None:
        found = [m for m in found if now - m.when <= within_s]
    return sorted(found, key=lambda m: (m.when, m.node))


def bad_nodes(where: Where, within_s: float) -> list[Mark]:
    """The nodes marked bad within the last `within_s` seconds: each node's newest mark, by node
    name; none when `within_s` is 0 (the site turned exclusion off)."""
    if within_s <= 0:
        return []
    newest: dict[str, Mark] = {}
    for m in marks(where, within_s):
        newest[m.node] = m
    return [newest[n] for n in sorted(newest)]


def clear(where: Where, node: str | None) -> int:
    """Forget every mark of `node` (every mark when None); how many were removed. A mark another
    user wrote is removed too where the folder lets the group (0775); else PermissionError."""
    if node is not None:
        check_node(node)
    removed = 0
    for path in _files(folder(where)):
        m = _read(path)
        if node is None or (m is not None and m.node == node):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def prune(where: Where, older_than_s: float) -> int:
    """Remove the marks older than `older_than_s` (that this user may remove); how many. Their
    files' times say it (written once, at the mark), so nothing is read."""
    removed, now = 0, time.time()
    for path in _files(folder(where)):
        try:
            if now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed += 1
        except OSError:
            pass  # gone already, or another user's and the folder is not the group's
    return removed

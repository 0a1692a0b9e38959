"""The site's node health record: which node was found bad, why, when, and by which job.

A preflight that finds a slow or unreachable node, and a job that ends naming a dead node, mark
it here; every later submission excludes the nodes marked within the site's
``health.exclude_for_h``, and ``hpcdist nodes`` lists and clears the marks. Both sides import this
module. The record is one folder (``hpcdist.config.paths.node_health``), each mark its own small
JSON file written atomically (``hpcdist.store.atomic``): a node, a reason, a time, a job id, a
host, nothing secret; its author is its file's owner, not what it says.

- On a scratch root others may write (a group's) the folder is the site admin's: owned by root
  (or the root's owner) and sticky (``chmod 3770``). hpcdist never makes it for a member; a
  missing one, a link, another member's or one not sticky is refused in one line with the
  admin's command (a reader warns and reads nothing from it). On a root of one's own the first
  writer makes it with the storage's folder mode.
- Marks are 0640 (storage.mode on a root of one's own); a group- or world-writable one is
  skipped: anyone could have written it. A member removes only her own files; she clears
  another's mark with a clear mark of her own (``<node>.<time>-....clear.json``): readers ignore
  a node's marks older than its newest clear mark. Root removes any file.
- A mark counts from the earlier of the times in its name and its text, or from its file's
  ctime (set by the kernel, never ahead) where those are later; never from later than now. A
  name dated more than ``FUTURE_SLACK_S`` ahead of the reader's clock is no mark at all: it is
  ignored, and said in the read's warning (a mark named for 2286 would otherwise sort first for
  ever, and a flood of them hide every real mark and clear mark). Marks older than ``KEEP_S``
  are removed by the next writer that may.
- A read is bounded: one ``os.listdir``, the names parsed in one regular-expression pass; a
  name older than the window, or dated ahead, is passed over; of the rest the ``MAX_READ``
  newest by name are opened (``O_NOFOLLOW | O_NONBLOCK``, ``fstat``: a regular file of at most
  ``MAX_MARK_BYTES``). What was skipped or left unread is named in one warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import socket
import stat
import time
import uuid
from dataclasses import asdict, dataclass
from operator import itemgetter
from pathlib import Path
from typing import Literal, get_args

from hpcdist.config.paths import node_health
from hpcdist.config.site import Site, Storage
from hpcdist.errors import ConfigError

Source = Literal["preflight", "node_failure", "timeout", "user"]
SOURCES: tuple[str, ...] = get_args(Source)
SHARED_FOLDER_MODE = 0o3770  # the admin's folder on a group's scratch root (docs/shared-sites.md)
FILE_MODE = 0o640  # a mark in the group's folder: the group reads it, only its author writes it
KEEP_S = 30 * 24 * 3600.0  # a mark older than this is removed by the next writer
MAX_READ = 256  # mark files one read opens at most: the newest by the time in their names
MAX_MARK_BYTES = 16384  # a mark is a few hundred bytes; anything bigger is not one
CLOCK_SLACK_S = 60.0  # how far a writer's clock may run ahead of the file server's
FUTURE_SLACK_S = 300.0  # a name dated further ahead of this reader's clock is ignored: no one wrote it then
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# name, node, time in ns (19 digits: 2001 to 2286), kind; over the whole listing at once (the node
# checked by _NODE where it is read: a lazy, unbounded pattern is several times faster)
_NAMES = re.compile(r"^(([\w.-]+?)\.(\d{19})-[\w-]+\.(mark|clear)\.json)$", re.M | re.A)
_LISTED = 5  # skipped files a warning names one by one


class HealthRecordError(ConfigError):
    """The node health record's folder is not one hpcdist may write: missing where only the site's
    admin may make it, not the admin's, or not writable by this user."""


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

    def describe(self) -> str:
        """``n2: preflight, job 812, 2026-11-24 02:40 UTC: all_reduce busbw 0.1 GB/s below ...``"""
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.when))
        job = f", job {self.job_id}" if self.job_id else ""
        return f"{self.node}: {self.source}{job}, {stamp}: {self.reason}"


@dataclass(frozen=True)
class Cleared:
    """What ``clear`` did: mark files removed, and marks of others a clear mark now overrides."""

    removed: int
    overridden: int = 0
    authors: tuple[str, ...] = ()  # whose marks are overridden


Where = Site | Storage | Path


def _storage(where: Where) -> Storage | None:
    return where.storage if isinstance(where, Site) else where if isinstance(where, Storage) else None


def folder(where: Where) -> Path:
    """The record's folder: a site's or storage's ``node_health`` path, or a folder given as is."""
    storage = _storage(where)
    return Path(str(where)) if storage is None else node_health(storage)


def check_node(node: str) -> str:
    if not _NODE.fullmatch(node):
        raise ConfigError(f"{node!r} is not a node name: one host name as Slurm lists it "
                          "(letters, digits, '.', '_', '-'), e.g. n3")
    return node


def _one_line(text: str, limit: int = 400) -> str:
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@dataclass(frozen=True)
class _Record:
    """Where the record is, and whether it is the group's (the folder above it others may write)."""

    path: Path
    above: os.stat_result | None  # the scratch root's stat; None when it does not exist yet
    storage: Storage | None

    @property
    def shared(self) -> bool:
        return self.above is not None and bool(self.above.st_mode & 0o022)

    @property
    def file_mode(self) -> int:
        return FILE_MODE if self.shared or self.storage is None else self.storage.mode

    def admin_command(self, replace: bool) -> str:
        """What the site's admin runs to make the folder (moving aside one that is not theirs)."""
        import grp

        gid = self.above.st_gid if self.above is not None else os.getegid()
        try:
            group = grp.getgrgid(gid).gr_name
        except KeyError:
            group = str(gid)
        d, aside = self.path, f"mv {self.path} {self.path}.old; " if replace else ""
        return (f"on a storage root the group shares it is the site's admin's folder; the admin runs: {aside}"
                f"mkdir {d}; chown root:{group} {d}; chmod {SHARED_FOLDER_MODE:o} {d}")


def _record(where: Where) -> _Record:
    path = folder(where)
    try:
        return _Record(path, os.stat(path.parent), _storage(where))
    except OSError:
        return _Record(path, None, _storage(where))


def _not_the_admins(rec: _Record) -> str | None:
    """Why the group's folder is not one the admin made (FileNotFoundError when it is missing)."""
    from hpcdist.store.trust import describe, owner_name

    st = os.lstat(rec.path)
    if not stat.S_ISDIR(st.st_mode):
        return f"{describe(rec.path, st)} is not a folder"
    if st.st_uid not in (0, rec.above.st_uid if rec.above is not None else 0):
        return f"{describe(rec.path, st)} was made by {owner_name(st.st_uid)}, not by the site's admin"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{describe(rec.path, st)} is writable by others and not sticky (anyone there may remove any mark)"
    return None


def _ready(rec: _Record, make: bool) -> bool:
    """True when the record's folder is there to write: on a root of one's own, made here when
    `make`; on the group's, the admin's folder or a HealthRecordError saying what the admin runs."""
    if not rec.shared:
        if make:
            from hpcdist.store.atomic import make_folders  # writers only: every Slurm render reads the record

            make_folders(rec.path, rec.storage.folder_mode if rec.storage is not None else 0o750)
        return rec.path.is_dir()
    try:
        why = _not_the_admins(rec)
    except FileNotFoundError:
        if not make:
            return False
        raise HealthRecordError(f"there is no node health record {rec.path}: {rec.admin_command(False)}") from None
    if why is not None:
        raise HealthRecordError(f"refusing the node health record: {why}; {rec.admin_command(True)}")
    return True


def _write(rec: _Record, node: str, ns: int, kind: str, entry: Mark) -> None:
    """A mark (or clear mark) file of this user's; a folder she may not write is one line."""
    from hpcdist.store.atomic import atomic_path
    from hpcdist.store.trust import describe

    name = f"{node}.{ns}-{os.getpid()}-{uuid.uuid4().hex[:8]}.{kind}.json"
    try:
        with atomic_path(rec.path / name, mode=rec.file_mode) as tmp:
            with open(tmp, "w") as fh:
                json.dump(asdict(entry), fh)
    except PermissionError as exc:
        fix = rec.admin_command(False) if rec.shared else "it is on a storage root of its owner's: ask them"
        raise HealthRecordError(f"cannot write to the node health record {describe(rec.path, os.stat(rec.path))}: "
                                f"{exc.strerror}; {fix}") from exc


def mark(where: Where, node: str, reason: str, job_id: str = "", source: Source = "user") -> Mark:
    """Record `node` as bad for `reason`, found by `source` in job `job_id`; its own new file
    (none when that job already marked that node from that source: the mark it made is returned).

    Raises ConfigError for a node name or source hpcdist cannot record, HealthRecordError when the
    record's folder is not one to write (what the admin runs), OSError when the shared storage
    cannot be written (a caller on a failure path reports either and goes on).
    """
    check_node(node)
    if source not in SOURCES:
        raise ConfigError(f"mark source {source!r} is not one of {', '.join(SOURCES)}")
    rec = _record(where)
    _ready(rec, make=True)
    if job_id:  # once per node, job and source: the ranks of one job, or two waiters, do not repeat it
        for m in _scan(rec, KEEP_S, node)[0]:
            if (m.job_id, m.source) == (job_id, source):
                return m
    from hpcdist.store.trust import current_user

    ns = time.time_ns()
    entry = Mark(node, _one_line(reason), ns / 1e9, _one_line(job_id, 40), source, current_user(), socket.gethostname())
    _write(rec, node, ns, "mark", entry)
    prune(rec.path, KEEP_S)
    return entry


class _Skipped(Exception):
    """An entry of the group's folder that is no mark: a link, a FIFO, a device, a huge file."""

    def __init__(self, why: str, owner: str = "") -> None:
        super().__init__(why)
        self.owner = owner


def _read(path: Path, node: str, named_s: float, now: float) -> Mark | None:
    """A mark (or clear mark) as its author wrote it, its time clamped (module docstring), or None
    when it was removed meanwhile; _Skipped for anything hpcdist did not write, so no newline
    reaches a job script and no odd node name reaches ``--exclude``."""
    from hpcdist.store.trust import describe, opened_plain, owner_name

    try:
        with opened_plain(path) as (fd, st):
            owner = owner_name(st.st_uid)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MARK_BYTES:
                raise _Skipped(f"{describe(path, st)}: not a regular file of at most {MAX_MARK_BYTES} bytes", owner)
            if st.st_mode & 0o022:
                raise _Skipped(f"{describe(path, st)}: group- or world-writable, so its owner may not be its "
                               "author", owner)
            raw = os.read(fd, MAX_MARK_BYTES + 1)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise _Skipped(f"{path}: a symbolic link, not a mark") from exc
        return None  # removed meanwhile
    try:
        data = json.loads(raw)
        said = float(data["when"])
        m = Mark(str(data["node"]), _one_line(str(data["reason"])), said, _one_line(str(data["job_id"]), 40),
                 str(data["source"]), owner, _one_line(str(data["host"]), 128))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _Skipped(f"{path}: not a mark hpcdist wrote ({type(exc).__name__})", owner) from exc
    if m.node != node or not _NODE.fullmatch(node) or m.source not in SOURCES or not math.isfinite(said):
        raise _Skipped(f"{path}: not a mark hpcdist wrote (its node, source or time)", owner)
    claimed = min(named_s, said)
    when = claimed if claimed <= st.st_ctime + CLOCK_SLACK_S else st.st_ctime  # dated ahead: from when written
    return Mark(m.node, m.reason, min(when, now), m.job_id, m.source, m.user, m.host)


def _listing(path: Path) -> list[str]:
    return os.listdir(path) if path.is_dir() else []


def _ns(seconds: float) -> str:
    """A time as the 19 digits of the names (strings of one length compare as the numbers do)."""
    return f"{max(0, int(seconds * 1e9)):019d}"


def _scan(rec: _Record, within_s: float, node: str | None = None) -> tuple[list[Mark], list[str]]:
    """The marks of the last `within_s` seconds (of `node`, when given) that no newer clear mark
    of their node overrides, and what the read has to warn of (bounded: module docstring)."""
    if rec.shared:
        try:
            why = _not_the_admins(rec)
        except FileNotFoundError:
            return [], []
        if why is not None:
            return [], [f"ignoring {why}; {rec.admin_command(True)}"]
    names = _listing(rec.path)
    text = "\n".join(names)
    found = _NAMES.findall(text)
    since, ahead = _ns((now := time.time()) - within_s), _ns(now + FUTURE_SLACK_S)
    future = [f for f in found if f[2] > ahead and (node is None or f[1] == node)]
    wanted = [f for f in found if since <= f[2] <= ahead and (node is None or f[1] == node)]
    # the MAX_READ newest not dated ahead (heapq.nlargest's own equivalent; no heapq for every render)
    chosen = sorted(wanted, key=itemgetter(2), reverse=True)[:MAX_READ]
    marks: list[Mark] = []
    cleared: dict[str, float] = {}
    skipped: list[str] = []
    owners: set[str] = set()
    for name, n, named, kind in chosen:
        try:
            m = _read(rec.path / name, n, int(named) / 1e9, now)
        except _Skipped as exc:
            skipped.append(str(exc))
            owners.add(exc.owner)
            continue
        if m is None or now - m.when > within_s:
            continue
        if kind == "clear":
            cleared[n] = max(cleared.get(n, 0.0), m.when)
        else:
            marks.append(m)
    notes = [f"skipped {s}" for s in skipped[:_LISTED]]
    if len(skipped) > _LISTED:
        notes.append(f"and {len(skipped) - _LISTED} more that are not marks ({', '.join(sorted(owners - {''}))}'s)")
    if len(wanted) > len(chosen):
        notes.append(f"{len(wanted) - len(chosen)} more files in {rec.path} left unread (a read opens the newest "
                     f"{MAX_READ}; the folder holds {len(names)} entries): the site's admin removes what is not a "
                     f"mark (ls -lt {rec.path})")
    if future:
        notes.append(_future_note(rec.path, future))
    others = len(names) - len(found) - text.count("\n.") - text.startswith(".")  # temporaries begin with "."
    if others > 0 and node is None:
        notes.append(f"{others} entries of {rec.path} are not marks by their names, left unread")
    return [m for m in marks if m.when > cleared.get(m.node, -1.0)], notes


def _future_note(path: Path, future: list[tuple[str, str, str, str]]) -> str:
    """What a read says of the names dated ahead of now, which it ignored: how many, how far, whose."""
    from hpcdist.store.trust import owner_name

    latest = sorted(future, key=itemgetter(2), reverse=True)
    owners = set()
    for name, *_ in latest[:_LISTED]:
        with contextlib.suppress(OSError):  # removed meanwhile
            owners.add(f"{owner_name(os.lstat(path / name).st_uid)}'s")
    stamp = time.strftime("%Y-%m-%d", time.gmtime(int(latest[0][2]) / 1e9))
    return (f"ignored {len(future)} marks in {path} dated more than {FUTURE_SLACK_S / 60:g} minutes ahead of now "
            f"(up to {', '.join([stamp, *sorted(owners)])}): no one wrote them then; the site's admin removes "
            f"them (ls -lt {path})")


def _said(notes: list[str]) -> None:
    """A read's one warning, on the "hpcdist" logger; logging loads here, not with the module:
    every Slurm ``render`` reads the record, and hardly ever has anything to say."""
    if notes:
        import logging

        logging.getLogger("hpcdist").warning("node health: %s", "; ".join(notes))


def marks(where: Where, within_s: float | None = None) -> list[Mark]:
    """Every standing mark (of the last `within_s` seconds, when given; else of ``KEEP_S``), oldest
    first; what the read skipped or left unread in one warning."""
    found, notes = _scan(_record(where), KEEP_S if within_s is None else within_s)
    _said(notes)
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


def clear(where: Where, node: str | None) -> Cleared:
    """Forget every mark of `node` (every mark when None): remove this user's own mark files (root:
    every file), then, where marks of others still stand, write a clear mark of one's own for their
    node, which every reader honours (the sticky folder lets no member remove another's file)."""
    if node is not None:
        check_node(node)
    rec = _record(where)
    if not _ready(rec, make=False):
        return Cleared(0)
    ours = [(name, kind) for name, n, _, kind in _NAMES.findall("\n".join(_listing(rec.path))) if node in (None, n)]
    removed = _remove_own(rec.path, [name for name, kind in ours if kind == "mark"])
    if os.geteuid() == 0:  # a member's own clear marks still override; root's clear leaves none
        _remove_own(rec.path, [name for name, kind in ours if kind == "clear"])
    standing, notes = _scan(rec, KEEP_S, node)
    _said(notes)
    from hpcdist.store.trust import current_user

    ns = time.time_ns()
    for n in sorted({m.node for m in standing}):
        _write(rec, n, ns, "clear", Mark(n, "cleared", ns / 1e9, "", "user", current_user(), socket.gethostname()))
    return Cleared(removed, len(standing), tuple(sorted({m.user for m in standing})))


def prune(where: Where, older_than_s: float) -> int:
    """Remove the marks older than `older_than_s` that this user may remove (her own; root: any);
    how many. The times in their names say it, so nothing is read."""
    path, cutoff = folder(where), _ns(time.time() - older_than_s)
    return _remove_own(path, [name for name, _, ns, _ in _NAMES.findall("\n".join(_listing(path))) if ns < cutoff])


def _remove_own(path: Path, names: list[str]) -> int:
    """Remove the files `names` of the folder `path` that this user may (her own; root: any); how many."""
    me, removed = os.geteuid(), 0
    for name in names:
        try:
            if me == 0 or os.lstat(path / name).st_uid == me:
                os.unlink(path / name)
                removed += 1
        except OSError:
            pass  # removed meanwhile
    return removed

"""The site's node health record: which node was found bad, why, when, and by which job.

A preflight that finds a slow or unreachable node, and a job that ends naming a dead node, mark
it here; every later submission excludes the nodes marked within the site's
``health.exclude_for_h``, and ``hpcdist nodes`` lists and clears the marks. Both sides import this
module. The record is one folder (``hpcdist.config.paths.node_health``), each mark its own small
JSON file written atomically (``hpcdist.files.atomic``): a node, a reason, a time, a job id, a
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

import json
import os
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcdist.config.paths import node_health
from hpcdist.config.site import Site, Storage
from hpcdist.errors import ConfigError
from hpcdist.store.records.health_marks import (  # noqa: F401  (MAX_READ, FUTURE_SLACK_S: the record's bounds)
    FILE_NAMES,
    FUTURE_SLACK_S,
    MAX_READ,
    NODE_NAME,
    SOURCES,
    Mark,
    Source,
    listing,
    name_time,
    one_line,
    read_folder,
)

SHARED_FOLDER_MODE = 0o3770  # the admin's folder on a group's scratch root (docs/shared-sites.md)
FILE_MODE = 0o640  # a mark in the group's folder: the group reads it, only its author writes it
KEEP_S = 30 * 24 * 3600.0  # a mark older than this is removed by the next writer


class HealthRecordError(ConfigError):
    """The node health record's folder is not one hpcdist may write: missing where only the site's
    admin may make it, not the admin's, or not writable by this user."""


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
    if not NODE_NAME.fullmatch(node):
        raise ConfigError(f"{node!r} is not a node name: one host name as Slurm lists it "
                          "(letters, digits, '.', '_', '-'), e.g. n3")
    return node


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


@contextmanager
def _storage_denied(where: Where, write: bool) -> Iterator[None]:
    """A scratch root she may not read (or write, when `write`) is the one line that names it
    and the key to set (``hpcdist.files.roots``); a record folder inside it she may not use is
    one HealthRecordError naming whose it is: never a PermissionError from deep in a read."""
    try:
        yield
    except PermissionError as exc:
        from hpcdist.files import roots

        storage = _storage(where)
        denied = None if storage is None else roots.explain(exc, storage, getattr(where, "name", "?"), write)
        if denied is not None:
            raise denied from exc
        why = roots.refusal(folder(where), write) or f"{exc.strerror} ({exc.filename})"
        raise HealthRecordError(f"cannot {'write to' if write else 'read'} the node health record: {why}; ask its "
                                f"owner, or set site health.exclude_for_h=0 to submit without the record") from exc


def _record(where: Where) -> _Record:
    path = folder(where)
    try:
        return _Record(path, os.stat(path.parent), _storage(where))
    except OSError:
        return _Record(path, None, _storage(where))


def _not_the_admins(rec: _Record) -> str | None:
    """Why the group's folder is not one the admin made (FileNotFoundError when it is missing)."""
    from hpcdist.files.trust import describe, owner_name

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
            from hpcdist.files.atomic import make_folders  # writers only: every Slurm render reads the record

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
    from hpcdist.files.atomic import atomic_path
    from hpcdist.files.trust import describe

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
    with _storage_denied(where, write=True):
        _ready(rec, make=True)
    if job_id:  # once per node, job and source: the ranks of one job, or two waiters, do not repeat it
        for m in _scan(rec, KEEP_S, node)[0]:
            if (m.job_id, m.source) == (job_id, source):
                return m
    from hpcdist.files.trust import current_user

    ns = time.time_ns()
    entry = Mark(node, one_line(reason), ns / 1e9, one_line(job_id, 40), source, current_user(), socket.gethostname())
    _write(rec, node, ns, "mark", entry)
    prune(rec.path, KEEP_S)
    return entry


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
    return read_folder(rec.path, within_s, node)


def _said(notes: list[str]) -> None:
    """A read's one warning, on the "hpcdist" logger; logging loads here, not with the module:
    every Slurm ``render`` reads the record, and hardly ever has anything to say."""
    if notes:
        import logging

        logging.getLogger("hpcdist").warning("node health: %s", "; ".join(notes))


def marks(where: Where, within_s: float | None = None) -> list[Mark]:
    """Every standing mark (of the last `within_s` seconds, when given; else of ``KEEP_S``), oldest
    first; what the read skipped or left unread in one warning."""
    with _storage_denied(where, write=False):
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
    with _storage_denied(where, write=True):
        if not _ready(rec, make=False):
            return Cleared(0)
    ours = [(name, kind) for name, n, _, kind in FILE_NAMES.findall("\n".join(listing(rec.path))) if node in (None, n)]
    removed = _remove_own(rec.path, [name for name, kind in ours if kind == "mark"])
    if os.geteuid() == 0:  # a member's own clear marks still override; root's clear leaves none
        _remove_own(rec.path, [name for name, kind in ours if kind == "clear"])
    standing, notes = _scan(rec, KEEP_S, node)
    _said(notes)
    from hpcdist.files.trust import current_user

    ns = time.time_ns()
    for n in sorted({m.node for m in standing}):
        _write(rec, n, ns, "clear", Mark(n, "cleared", ns / 1e9, "", "user", current_user(), socket.gethostname()))
    return Cleared(removed, len(standing), tuple(sorted({m.user for m in standing})))


def prune(where: Where, older_than_s: float) -> int:
    """Remove the marks older than `older_than_s` that this user may remove (her own; root: any);
    how many. The times in their names say it, so nothing is read."""
    path, cutoff = folder(where), name_time(time.time() - older_than_s)
    return _remove_own(path, [name for name, _, ns, _ in FILE_NAMES.findall("\n".join(listing(path))) if ns < cutoff])


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

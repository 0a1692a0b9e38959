"""The node health record's files: a mark's shape, its file name, and the bounded read of a folder
of them (``hpcdist.store.records.health`` owns the record: where it is, who may write it, writing,
clearing). Split from it because reading a folder every member writes is a concept of its own:
one listing, the names parsed at once, the newest ``MAX_READ`` not dated ahead opened without
following links or blocking, anything hpcdist did not write skipped and named in one warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Literal, get_args

Source = Literal["preflight", "node_failure", "timeout", "user"]
SOURCES: tuple[str, ...] = get_args(Source)
MAX_READ = 256  # mark files one read opens at most: the newest by the time in their names
MAX_MARK_BYTES = 16384  # a mark is a few hundred bytes; anything bigger is not one
CLOCK_SLACK_S = 60.0  # how far a writer's clock may run ahead of the file server's
FUTURE_SLACK_S = 300.0  # a name dated further ahead of this reader's clock is ignored: no one wrote it then
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# name, node, time in ns (19 digits: 2001 to 2286), kind; over the whole listing at once (the node
# checked by NODE_NAME where it is read: a lazy, unbounded pattern is several times faster)
FILE_NAMES = re.compile(r"^(([\w.-]+?)\.(\d{19})-[\w-]+\.(mark|clear)\.json)$", re.M | re.A)
_LISTED = 5  # skipped files a warning names one by one



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


def one_line(text: str, limit: int = 400) -> str:
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class _Skipped(Exception):
    """An entry of the group's folder that is no mark: a link, a FIFO, a device, a huge file."""

    def __init__(self, why: str, owner: str = "") -> None:
        super().__init__(why)
        self.owner = owner


def read_mark(path: Path, node: str, named_s: float, now: float) -> Mark | None:
    """A mark (or clear mark) as its author wrote it, its time clamped (module docstring), or None
    when it was removed meanwhile; _Skipped for anything hpcdist did not write, so no newline
    reaches a job script and no odd node name reaches ``--exclude``."""
    from hpcdist.files.trust import describe, opened_plain, owner_name

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
        m = Mark(str(data["node"]), one_line(str(data["reason"])), said, one_line(str(data["job_id"]), 40),
                 str(data["source"]), owner, one_line(str(data["host"]), 128))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _Skipped(f"{path}: not a mark hpcdist wrote ({type(exc).__name__})", owner) from exc
    if m.node != node or not NODE_NAME.fullmatch(node) or m.source not in SOURCES or not math.isfinite(said):
        raise _Skipped(f"{path}: not a mark hpcdist wrote (its node, source or time)", owner)
    claimed = min(named_s, said)
    when = claimed if claimed <= st.st_ctime + CLOCK_SLACK_S else st.st_ctime  # dated ahead: from when written
    return Mark(m.node, m.reason, min(when, now), m.job_id, m.source, m.user, m.host)


def listing(path: Path) -> list[str]:
    return os.listdir(path) if path.is_dir() else []


def name_time(seconds: float) -> str:
    """A time as the 19 digits of the names (strings of one length compare as the numbers do)."""
    return f"{max(0, int(seconds * 1e9)):019d}"


def read_folder(path: Path, within_s: float, node: str | None = None) -> tuple[list[Mark], list[str]]:
    """The marks in `path` of the last `within_s` seconds (of `node`, when given) that no newer
    clear mark of their node overrides, and what the read has to warn of (bounded: module docstring)."""
    names = listing(path)
    text = "\n".join(names)
    found = FILE_NAMES.findall(text)
    since, ahead = name_time((now := time.time()) - within_s), name_time(now + FUTURE_SLACK_S)
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
            m = read_mark(path / name, n, int(named) / 1e9, now)
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
        notes.append(f"{len(wanted) - len(chosen)} more files in {path} left unread (a read opens the newest "
                     f"{MAX_READ}; the folder holds {len(names)} entries): the site's admin removes what is not a "
                     f"mark (ls -lt {path})")
    if future:
        notes.append(_future_note(path, future))
    others = len(names) - len(found) - text.count("\n.") - text.startswith(".")  # temporaries begin with "."
    if others > 0 and node is None:
        notes.append(f"{others} entries of {path} are not marks by their names, left unread")
    return [m for m in marks if m.when > cleared.get(m.node, -1.0)], notes


def _future_note(path: Path, future: list[tuple[str, str, str, str]]) -> str:
    """What a read says of the names dated ahead of now, which it ignored: how many, how far, whose."""
    from hpcdist.files.trust import owner_name

    latest = sorted(future, key=itemgetter(2), reverse=True)
    owners = set()
    for name, *_ in latest[:_LISTED]:
        with contextlib.suppress(OSError):  # removed meanwhile
            owners.add(f"{owner_name(os.lstat(path / name).st_uid)}'s")
    stamp = time.strftime("%Y-%m-%d", time.gmtime(int(latest[0][2]) / 1e9))
    return (f"ignored {len(future)} marks in {path} dated more than {FUTURE_SLACK_S / 60:g} minutes ahead of now "
            f"(up to {', '.join([stamp, *sorted(owners)])}): no one wrote them then; the site's admin removes "
            f"them (ls -lt {path})")

"""What one rank's stack file holds, and the grouping of many: ``hpcdist stacks`` and the summary
of a job whose collective or rendezvous timed out print the same groups from the same function.

A rank writes its record (``hpcdist.runtime.stacks``); the login side reads every rank's
(``read_stacks``), groups the ranks whose job thread stands at the same frames (``group``) and
says each group in one line: the innermost frame of the user's code and the collective it is in
("all_reduce, called at train.py:88"). Structured frames, not faulthandler's text, are what
make the grouping and the "where" possible. Standard library only: the login side imports it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.files.atomic import atomic_path

if TYPE_CHECKING:
    from hpcdist.config.paths import JobPaths

# A frame's kind, decided on the rank (where the installed packages are known): the job's own
# code, torch.distributed, or any other library (the standard library, site-packages, hpcdist's
# own plumbing between the launcher and the job's code).
USER, DIST, LIB = "user", "dist", "lib"
TIMEOUT_REQUEST = "timeout"  # how a request made by a rank that timed out begins


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str = ""
    kind: str = LIB

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass(frozen=True)
class ThreadStack:
    name: str
    main: bool  # the thread that runs the job
    frames: tuple[Frame, ...]  # outermost first


@dataclass(frozen=True)
class Collectives:
    """The flight recorder's word on this rank's default group: sequence numbers of the last
    collective enqueued and completed, and the last one's name (``gloo:all_reduce``)."""

    last_enqueued: int
    last_completed: int
    last_name: str

    def text(self, timed_out: bool = False) -> str:
        """``last collective #5 all_reduce, not completed``; at a timeout the recorder counts the
        collective that failed as completed, so it says ``timed out``."""
        state = "completed" if self.last_completed >= self.last_enqueued else "not completed"
        name = self.last_name.split(":")[-1] or "?"
        return f"last collective #{self.last_enqueued} {name}, {'timed out' if timed_out else state}"


@dataclass(frozen=True)
class RankStack:
    """One rank's answer to one request."""

    rank: int
    host: str
    pid: int
    request: str  # the request it answers
    written: float  # time.time() when taken
    why: str  # "asked", or the failure it was taken at ("timeout: ...")
    threads: tuple[ThreadStack, ...]
    collectives: Collectives | None = None
    recorder: str = ""  # why there are no collectives, when there are none

    @property
    def timed_out(self) -> bool:
        """Taken by a rank at its own timeout (not in answer to a request)."""
        return self.why.startswith(TIMEOUT_REQUEST)

    @property
    def main(self) -> tuple[Frame, ...]:
        return next((t.frames for t in self.threads if t.main), ())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankStack:
        raw: dict[str, Any] = json.loads(text)
        threads = tuple(ThreadStack(t["name"], bool(t["main"]), tuple(Frame(**f) for f in t["frames"]))
                        for t in raw.pop("threads"))
        coll = raw.pop("collectives")
        return cls(threads=threads, collectives=Collectives(**coll) if coll else None, **raw)


def ask(paths: JobPaths, what: str) -> tuple[str, float]:
    """Ask every rank of the job for its stack (`what`: who asks); the request and its time."""
    request = f"{what} {uuid.uuid4().hex[:12]}"
    asked = time.time()
    with atomic_path(paths.stacks_request) as tmp:
        tmp.write_text(request + "\n")
    return request, asked


def stack_files(paths: JobPaths, world_size: int) -> dict[int, Path]:
    return {r: paths.stack_file(r) for r in range(world_size)}


def wait_answers(files: dict[int, Path], since: float, timeout_s: float, request: str = "",
                 poll_s: float = 0.2, timeouts_since: float | None = None) -> dict[int, RankStack]:
    """The answers written at `since` or later (to `request`, when given), once every rank of
    `files` answered or after `timeout_s`. With `timeouts_since`, a rank's stack taken at its own
    timeout at that time or later also answers: that rank may have failed and left already."""
    deadline = time.monotonic() + timeout_s
    oldest = since if timeouts_since is None else min(since, timeouts_since)
    while True:
        got = {r: s for r, s in read_stacks(files, oldest).items()
               if (s.written >= since and (not request or s.request == request)) or (
                   timeouts_since is not None and s.timed_out)}
        if len(got) == len(files) or time.monotonic() >= deadline:
            return got
        time.sleep(poll_s)


def read_stacks(files: dict[int, Path], since: float = 0.0) -> dict[int, RankStack]:
    """The records of the ranks whose file was written at `since` or later (rank -> record);
    a missing, older or unreadable file is a rank that did not answer."""
    out: dict[int, RankStack] = {}
    for rank, path in files.items():
        try:
            record = RankStack.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if record.written >= since:
            out[rank] = record
    return out


def where(frames: tuple[Frame, ...]) -> tuple[Frame | None, str]:
    """The innermost frame of the user's code, and the torch.distributed call it is in ("" if
    none): the first public function called from that frame, past torch's logging wrappers."""
    users = [i for i, f in enumerate(frames) if f.kind == USER]
    if not users:
        return (frames[-1] if frames else None), ""
    i = users[-1]
    call = next((f.function for f in frames[i + 1:]
                 if f.kind == DIST and not f.function.startswith("_") and f.function != "wrapper"), "")
    return frames[i], call


def say_where(frames: tuple[Frame, ...]) -> str:
    """``all_reduce, called at train.py:88`` or ``train.py:80 in main: time.sleep(60)``."""
    frame, call = where(frames)
    if frame is None:
        return "no Python frame in the job's thread"
    if call:
        return f"{call}, called at {frame.short()}"
    return f"{frame.short()} in {frame.function}" + (f": {frame.code}" if frame.code else "")


def ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0-1,4``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


@dataclass(frozen=True)
class Group:
    """Ranks whose job thread stands at the same frames."""

    ranks: list[int]
    frames: tuple[Frame, ...]
    where: str
    collectives: dict[int, str] = field(default_factory=dict)  # rank -> flight recorder's line

    def line(self) -> str:
        seen = sorted(set(self.collectives.values()))
        coll = f" [{seen[0]}]" if len(seen) == 1 else "".join(
            f" [{ranks_text([r])}: {c}]" for r, c in sorted(self.collectives.items()))
        return f"{ranks_text(self.ranks)}: {self.where}{coll}"

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "where": self.where, "collectives": self.collectives,
                "frames": [asdict(f) for f in self.frames]}


def group(stacks: dict[int, RankStack]) -> list[Group]:
    """The ranks grouped by their job thread's frames (file, line, function), largest group
    first, then by first rank."""
    by_key: dict[tuple[tuple[str, int, str], ...], list[int]] = {}
    for rank in sorted(stacks):
        key = tuple((f.file, f.line, f.function) for f in stacks[rank].main)
        by_key.setdefault(key, []).append(rank)
    groups = []
    for ranks in by_key.values():
        frames = stacks[ranks[0]].main
        coll = {r: c.text(stacks[r].timed_out) for r in ranks if (c := stacks[r].collectives) is not None}
        groups.append(Group(ranks, frames, say_where(frames), coll))
    return sorted(groups, key=lambda g: (-len(g.ranks), g.ranks[0]))


def elsewhere(groups: list[Group]) -> str:
    """When most ranks stand in one place: the others, named with where they are; else ""."""
    if len(groups) < 2 or len(groups[0].ranks) == len(groups[1].ranks):
        return ""
    others = "; ".join(f"{ranks_text(g.ranks)} at {g.where}" for g in groups[1:])
    return f"{ranks_text(groups[0].ranks)} wait in {groups[0].where}; elsewhere: {others}"


def describe(stacks: dict[int, RankStack], world_size: int, verbose: bool = False) -> list[str]:
    """The lines both the command and the summary print: one per group (every frame of the job
    thread under it with `verbose`), the ranks that were elsewhere, the ranks that did not answer."""
    groups = group(stacks)
    lines = []
    for g in groups:
        lines.append(g.line())
        if verbose:
            lines += [f"    {f.file}:{f.line} in {f.function}" + (f": {f.code}" if f.code else "") for f in g.frames]
    note = elsewhere(groups)
    if note:
        lines.append(note)
    missing = [r for r in range(world_size) if r not in stacks]
    if missing:
        lines.append(f"{ranks_text(missing)}: no answer (not started, ended, or holding Python's lock in native code)")
    notes = sorted({s.recorder for s in stacks.values() if s.recorder})
    lines += [f"note: {n}" for n in notes]
    return lines

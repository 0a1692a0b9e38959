"""Every rank's Python stack on request, without a signal: for ``hpcdist stacks`` and for the
summary of a job whose collective or rendezvous timed out.

The request travels as a file in the job's folder (``JobPaths.stacks_request``), not as a
signal: the site's preemption signal (USR1 or USR2) is the only one torchrun's agent survives and
mpirun's batch shell forwards, so any other would kill an agent or miss the first node's ranks.
A daemon thread started by the bootstrap reads that file once a second (open and read, not stat:
NFS revalidates a file on open, while a stat may be served from its attribute cache for up to a
minute) and, when it holds a new request, writes this rank's answer: every thread's stack from
``sys._current_frames`` (structured frames, which the login side groups and faulthandler's text
would not give) and the flight recorder's last collective, into one file per rank (mpirun gives
no per-rank stderr). Python frames are what can be shown: a rank that holds Python's lock in
native code cannot answer, and is named as silent.

When this rank's collective or rendezvous times out (``on_failure``), before the job fails, it
records its own stack at the raise, asks every other rank the same way, logs its stack and waits
a few seconds for the others' answers, which they also write into their logs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import replace
from typing import Any

from hpcdist.config.paths import JobPaths
from hpcdist.files.atomic import atomic_path
from hpcdist.store.records.stackrecord import (
    DIST,
    LIB,
    TIMEOUT_REQUEST,
    USER,
    Collectives,
    Frame,
    RankStack,
    ThreadStack,
    ask,
    wait_answers,
)

log = logging.getLogger("hpcdist")

INTERVAL_S = 1.0  # how often a rank reads the request file
ANSWER_WAIT_S = 3.0  # how long a rank that timed out waits for the others' answers
WATCHER_NAME = "hpcdist-stacks"  # left out of the stacks it takes
FR_VAR, FR_ENTRIES = "TORCH_FR_BUFFER_SIZE", "200"  # torch's flight recorder: on, with a small ring

_HPCDIST = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PLUMBING = tuple(os.path.join(_HPCDIST, d) + os.sep for d in ("runtime", "api", "jobs"))
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for k, p in sysconfig.get_paths().items()
                           if k in ("stdlib", "platstdlib", "purelib", "platlib")}))
# whole words: a setting's name in a message ("checkpoint.io_timeout_s", said where a peer's
# connection was reset) is not a timeout, and taking it for one held a rank in the stacks' wait
# past its in-job supervisor's patience (it was then killed and started again as a hung rank)
_TIMEOUT = re.compile(r"\btimed? ?out\b|\btimeout\b|did not join within", re.IGNORECASE)


def frame_kind(file: str) -> str:
    """The job's own code (hpcdist's built-in jobs included), torch.distributed, or a library
    (the standard library, the installed packages, hpcdist's plumbing around the job)."""
    path = os.path.abspath(file)
    if f"{os.sep}torch{os.sep}distributed{os.sep}" in path:
        return DIST
    if path.startswith(_HPCDIST + os.sep):
        return LIB if path.startswith(_PLUMBING) else USER
    if file.startswith("<") or path.startswith(_LIBRARIES):
        return LIB
    return USER


def _frames(summary: traceback.StackSummary) -> tuple[Frame, ...]:
    return tuple(Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip(), frame_kind(f.filename))
                 for f in summary)


def capture(rank: int, host: str, why: str, exc: BaseException | None = None) -> RankStack:
    """Every thread's stack now but the watcher's; the calling thread's at the raise of `exc`
    when given (it is handling `exc`)."""
    me, main = threading.get_ident(), threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == WATCHER_NAME:
            continue
        if ident == me and exc is not None and exc.__traceback__ is not None:
            tb = exc.__traceback__
            outer = tb.tb_frame.f_back
            summary = traceback.StackSummary.from_list(
                (traceback.extract_stack(outer) if outer is not None else []) + traceback.extract_tb(tb))
        else:
            summary = traceback.extract_stack(frame)
        threads.append(ThreadStack(names.get(ident, f"thread {ident}"), ident == main, _frames(summary)))
    threads.sort(key=lambda t: not t.main)
    collectives, note = last_collective()
    return RankStack(rank, host, os.getpid(), "", time.time(), why, tuple(threads), collectives, note)


# torch's flight recorders, by what each torch build exposes: NCCL's own (the collectives of a
# CUDA build's NCCL groups: JSON from torch 2.4, a pickle in 2.3) holds what the generic one
# (gloo's, torch 2.6 on) leaves empty under NCCL: on an H100 the generic dump had 0 entries and
# no pg_status while NCCL's showed the pending all_reduce.
_NCCL_DUMPS = (("_dump_nccl_trace_json", "json"), ("_dump_nccl_trace", "pickle"))
_GENERIC_DUMPS = (("_dump_fr_trace_json", "json"), ("_dump_fr_trace", "pickle"))


def flight_record(backend: str, only_active: bool = False) -> dict[str, Any]:
    """torch's flight recorder for a group of `backend`, as a dict (``entries``, ``pg_status``):
    NCCL's own recorder for ``nccl``, the generic one otherwise (or where the build has no NCCL's),
    by the first dump function the build has. Raises where none can be read (no group yet, the
    recorder off, or a private API torch changed): callers treat that as nothing to see."""
    import torch._C._distributed_c10d as c10d

    names = (*_NCCL_DUMPS, *_GENERIC_DUMPS) if backend == "nccl" else _GENERIC_DUMPS
    for name, form in names:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        if form == "json":
            return dict(json.loads(dump(includeCollectives=True, onlyActive=only_active)))
        import pickle

        # torch's own bytes from this process, not data anyone else wrote
        return dict(pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=only_active)))
    raise RuntimeError(f"this torch has no flight recorder dump ({', '.join(n for n, _ in names)})")


def last_collective() -> tuple[Collectives | None, str]:
    """torch's flight recorder on the default group: the last collective enqueued and completed
    (NCCL's own recorder under NCCL, the generic one, which records gloo, otherwise); or why
    there is none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None, ""
    if os.environ.get(FR_VAR, "0") in ("", "0"):
        return None, f"torch's flight recorder is off ({FR_VAR}=0): no collective sequence numbers"
    try:
        dump = flight_record(str(dist.get_backend()))
        status = dump.get("pg_status", {}).get("0", {})
        enqueued, completed = int(status["last_enqueued_collective"]), int(status["last_completed_collective"])
    except Exception as exc:  # a private API: its absence or change is a note, never a failure
        return None, f"torch's flight recorder could not be read ({type(exc).__name__}: {exc})"
    name = next((str(e.get("profiling_name", "")) for e in reversed(dump.get("entries", []))
                 if e.get("pg_id") == 0 and int(e.get("collective_seq_id", -1)) == enqueued), "")
    return Collectives(enqueued, completed, name), ""


def text(record: RankStack) -> str:
    """A record as Python prints a traceback, thread by thread (for the rank's log)."""
    out = []
    for t in record.threads:
        out.append(f"thread {t.name}{' (the job)' if t.main else ''}, most recent call last:")
        out += [f'  File "{f.file}", line {f.line}, in {f.function}' + (f"\n    {f.code}" if f.code else "")
                for f in t.frames]
    if record.collectives is not None:
        out.append(record.collectives.text())
    return "\n".join(out)


class Watcher(threading.Thread):
    """This rank's reader of the request file, and the writer of its answers."""

    def __init__(self, paths: JobPaths, rank: int, world_size: int, host: str,
                 interval_s: float = INTERVAL_S) -> None:
        super().__init__(name=WATCHER_NAME, daemon=True)
        self.paths, self.rank, self.world_size, self.host = paths, rank, world_size, host
        self.interval_s = interval_s
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._failed: RankStack | None = None  # this rank's stack when it timed out
        self.started = time.time()  # a stack taken at another rank's timeout since then is of this run
        self._logged = False  # its stack logged once for the timeouts of other ranks

    def _request(self) -> str:
        try:
            with open(self.paths.stacks_request) as f:
                return f.read(200).strip()
        except OSError:
            return ""

    def run(self) -> None:
        seen = self._request()  # a request made before this rank started is not for it
        while not self._done.wait(self.interval_s):
            request = self._request()
            if request and request != seen:
                seen = request
                try:
                    self.answer(request)
                except Exception as exc:  # noqa: BLE001 - a failed answer must not end the rank
                    log.warning("could not write this rank's stack for %r: %s", request, exc)

    def answer(self, request: str) -> None:
        """This rank's stack (its stack at the timeout, once it timed out) for `request`."""
        with self._lock:
            record = self._failed or capture(self.rank, self.host, "asked")
            self._write(replace(record, request=request, written=time.time()))
        if request.startswith(TIMEOUT_REQUEST) and self._failed is None and not self._logged:
            self._logged = True
            log.error("another rank timed out and asked for every stack; this rank's:\n%s", text(record))

    def _write(self, record: RankStack) -> None:
        with atomic_path(self.paths.stack_file(self.rank)) as tmp:
            tmp.write_text(record.to_json())

    def timed_out(self, exc: BaseException) -> None:
        """Record this rank's stack at the raise of `exc` (once), log it, ask every other rank
        for theirs and wait a few seconds for them to answer."""
        with self._lock:
            if self._failed is not None:
                return
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._failed = capture(self.rank, self.host, f"timeout: {first[:300]}", exc)
            self._write(self._failed)
        log.error("%s; this rank's stack at the timeout:\n%s", self._failed.why, text(self._failed))
        try:
            _, asked = ask(self.paths, f"{TIMEOUT_REQUEST} rank{self.rank}")
        except OSError as exc_ask:
            log.warning("could not ask the other ranks for their stacks: %s", exc_ask)
            return
        files = {r: self.paths.stack_file(r) for r in range(self.world_size) if r != self.rank}
        wait_answers(files, asked, ANSWER_WAIT_S, timeouts_since=self.started)

    def stop(self) -> None:
        self._done.set()


_WATCHER: list[Watcher] = []  # this process's one watcher (one rank per process)


def start(paths: JobPaths, rank: int, world_size: int, host: str, launch: float = float("nan")) -> Watcher:
    """Start answering requests (once per process); turns torch's flight recorder on unless the
    user set it, which must happen before the process group is made. Rank 0 first removes the
    stacks an earlier run of the job left (written before this run's `launch`), so the summary of
    this run's end never shows them."""
    os.environ.setdefault(FR_VAR, FR_ENTRIES)
    if rank == 0 and launch == launch:
        clear_earlier(paths, launch)
    if not _WATCHER:
        watcher = Watcher(paths, rank, world_size, host)
        watcher.start()
        _WATCHER.append(watcher)
    return _WATCHER[0]


def clear_earlier(paths: JobPaths, launch: float) -> None:
    """Remove every rank's stack file written before `launch` (an earlier run's; any world size)."""
    for path in paths.progress.glob("stack_rank*.json"):
        try:
            if RankStack.from_json(path.read_text()).written < launch:
                path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            continue


def stop() -> None:
    while _WATCHER:
        _WATCHER.pop().stop()


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it came from, is a timeout (torch's, gloo's, hpcdist's)."""
    from hpcdist.errors import chain

    return any(isinstance(cur, TimeoutError) or _TIMEOUT.search(str(cur)) for cur in chain(exc))


def on_failure(exc: BaseException) -> None:
    """Called where a rank's job fails, before anything else: a timeout records every rank's
    stack (this rank's at the raise); any other failure, nothing."""
    if _WATCHER and is_timeout(exc):
        _WATCHER[0].timed_out(exc)



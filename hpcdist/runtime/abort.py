"""When the backend ends the rank itself: hpcdist's summary written before NCCL's watchdog aborts
(rank side).

Under NCCL a collective that times out raises nothing in Python (``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
torch's default): torch's watchdog thread tears the process down with SIGABRT, measured 15 to 60 s
after the timeout on an H100 (docs/gpus.md). What a raised timeout does on gloo (name the rank and
node that did not answer, mark the health record, keep a benchmark's rows, every rank's stack)
would wait for an exception that never comes.

So a daemon thread started by the bootstrap reads torch's flight recorder (on for ``hpcdist
stacks``; NCCL's own recorder under NCCL, ``hpcdist.runtime.stacks.flight_record``: the generic one
holds nothing of NCCL's collectives) twice a second; when a collective of this rank has waited its
timeout, NCCL's own test,
it does that work at once, in the window before the abort: this rank's last words first (the
error it would have raised, ``hpcdist.store.records.last_error``, which the summary shows for a rank that
left no result), then the roll call over the rendezvous store (``hpcdist.runtime.rollcall``: the
nodes whose ranks did not answer are named, and marked in the health record by the lowest rank
that answered), what the running ``phase`` keeps (a benchmark's rows so far), the last words
again with all of that, and every rank's stack (``hpcdist.runtime.stacks``): within
``rollcall.ROLL_CALL_S`` plus ``stacks.ANSWER_WAIT_S`` (8 s) of the timeout. The abort then comes
from NCCL, or, once the flight recorder's dump is in the job's folder (``TORCH_NCCL_DUMP_ON_TIMEOUT``
is turned on unless set) or at most ``GRACE_S`` after the summary, the rank ends itself (exit
``ENDED_EXIT``): NCCL's own abort came 15 to 72 s after the timeout on an H100, and never with
error handling 0 or 2. A rank so ends within its timeout plus about 25 s.

Under gloo a timeout raises, and this thread does nothing, unless a test makes gloo end a rank as
NCCL does (``IMITATE_ABORT_VAR``): the group's own timeout is then long, and a second thread
aborts the rank (``os.abort``, from outside the job thread blocked in the collective) that many
seconds after the job's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcdist.config.contract import HUNG_EXIT, IMITATE_ABORT_VAR
from hpcdist.store.records import last_error

if TYPE_CHECKING:
    from hpcdist.config.paths import JobPaths
    from hpcdist.runtime.job_rank import JobRank

log = logging.getLogger("hpcdist")

INTERVAL_S = 0.5  # how often the flight recorder is read
GRACE_S = 15.0  # after the summary, the longest a rank waits for NCCL's abort (and its dump) before it ends itself
ENDED_EXIT = HUNG_EXIT  # the exit status of a rank that ended itself after its summary
DUMP_VAR, DUMP_FILE_VAR = "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"


@dataclass(frozen=True)
class Phase:
    what: str  # "training step 12 (forward and backward)", "all_reduce at size 1 MiB ..."
    error: str  # the error class the summary line names
    on_timeout: Callable[[str], str] | None  # given the failure, keeps what it has; a note to add


_PHASES: list[Phase] = []


@contextlib.contextmanager
def phase(what: str, error: str = "JobError", on_timeout: Callable[[str], str] | None = None) -> Iterator[None]:
    """Name what the job is doing: a collective of it that the backend times out is named by
    `what`, and `on_timeout` runs before the backend ends the rank (it is given the failure
    and returns a note for the error, such as where the rows so far are)."""
    _PHASES.append(Phase(what, error, on_timeout))
    try:
        yield
    finally:
        _PHASES.pop()


def imitated(env: Mapping[str, str]) -> float | None:
    """The seconds after the timeout at which a test has gloo abort the rank, or None."""
    try:
        return float(env[IMITATE_ABORT_VAR])
    except (KeyError, ValueError):
        return None


def group_timeout(timeout_s: float, backend: str, env: Mapping[str, str]) -> float:
    """The timeout the default group is made with: the job's, or, where a test has gloo imitate
    NCCL, one past the imitated abort (so that gloo never raises first)."""
    delay = imitated(env)
    return timeout_s + delay + 600.0 if delay is not None and backend == "gloo" else timeout_s


def prepare(paths: JobPaths, rank: int, launch: float) -> None:
    """Before the group is made: the flight recorder's dump on a timeout, into the job's folder
    (unless the user set either); rank 0 removes the last words an earlier run left."""
    os.environ.setdefault(DUMP_VAR, "1")
    os.environ.setdefault(DUMP_FILE_VAR, str(paths.progress / "flight_recorder_rank"))
    if rank == 0 and not math.isnan(launch):  # no launch time: nothing to tell an earlier run's words by
        last_error.clear_earlier(paths.progress, launch)


@dataclass(frozen=True)
class Overdue:
    op: str  # "all_reduce #7 (default_pg)"
    limit_s: float


def overdue(limit_s: float | None, backend: str = "nccl") -> Overdue | None:
    """The first collective of this rank, under NCCL, still waiting past its timeout (or past
    `limit_s`, of any backend, when given), from `backend`'s flight recorder; None when there is
    none or no flight recorder."""
    from hpcdist.runtime.stacks import flight_record

    try:
        entries = flight_record(backend, only_active=True).get("entries", [])
    except Exception:  # no group yet, the recorder off, or torch changed its private API: nothing to see
        return None
    now = time.time_ns()
    for e in entries:
        name = str(e.get("profiling_name", ""))
        if e.get("retired") or e.get("state") == "completed" or (limit_s is None and not name.startswith("nccl:")):
            continue
        limit = limit_s if limit_s is not None else float(e.get("timeout_ms", 0)) / 1000.0
        if limit > 0 and now - int(e.get("time_created_ns", now)) >= limit * 1e9:
            seq = e.get("collective_seq_id") or e.get("p2p_seq_id")
            group = e.get("process_group", ["", ""])[-1]
            return Overdue(f"{name.split(':')[-1]} #{seq} ({group})", limit)
    return None


class Watch(threading.Thread):
    """This rank's reader of the flight recorder, and the writer of its summary once a collective
    is overdue (once per process)."""

    def __init__(self, ctx: JobRank, delay_s: float | None) -> None:
        super().__init__(name="hpcdist-abort-watch", daemon=True)
        self.ctx = ctx
        self.imitating = delay_s is not None
        self.fired = threading.Event()
        self._done = threading.Event()

    def run(self) -> None:
        limit = self.ctx.timeout_s if self.imitating else None
        while not self._done.wait(INTERVAL_S):
            late = overdue(limit, self.ctx.backend)
            if late is not None:
                self.fired.set()
                self.summarise(late)
                # the test's imitated abort comes within GRACE_S; NCCL's dump, then this rank's end
                stopped = self._done.wait(GRACE_S) if self.imitating else not self._dumped(GRACE_S)
                if stopped:
                    return
                log.error("this rank's summary is written and NCCL has not ended it: ending it (exit %d)", ENDED_EXIT)
                logging.shutdown()
                sys.stderr.flush()
                os._exit(ENDED_EXIT)

    def _dumped(self, within_s: float) -> bool:
        """Waits until the flight recorder's dump of this rank is written (a size that holds for
        one interval) or `within_s` passed; False if the watch was stopped meanwhile."""
        target = Path(os.environ.get(DUMP_FILE_VAR, "") + str(self.ctx.rank))
        end, size = time.monotonic() + within_s, -1
        while time.monotonic() < end:
            if self._done.wait(INTERVAL_S):
                return False
            now = target.stat().st_size if os.environ.get(DUMP_FILE_VAR) and target.is_file() else -1
            if now > 0 and now == size:
                return True
            size = now
        return True

    def summarise(self, late: Overdue) -> None:
        from hpcdist.runtime import stacks
        from hpcdist.runtime.rollcall import failure_message

        ctx, here = self.ctx, _PHASES[-1] if _PHASES else None
        who = "the backend (imitating NCCL's watchdog)" if self.imitating else "NCCL's watchdog"
        cause = TimeoutError(f"{late.op} did not complete within {late.limit_s:g} s; {who} ends this rank")
        what, error = (here.what, here.error) if here is not None else ("the job", "JobError")
        self._say(error, f"{what} failed on rank {ctx.rank} ({ctx.hosts[ctx.rank]}): TimeoutError: {cause}")
        full = failure_message(what, ctx.rank, ctx.hosts, cause, ctx.site, ctx.job_id)
        if here is not None and here.on_timeout is not None:
            try:
                full += here.on_timeout(full)
            except Exception as exc:  # noqa: BLE001 - what is kept is extra; the failure is the news
                log.warning("could not keep what %s had: %s", what, exc)
        self._say(error, full)
        stacks.on_failure(cause)

    def _say(self, error: str, message: str) -> None:
        """This rank's error: in its last-words file, its log and its stderr (as a raise would)."""
        try:
            last_error.write(self.ctx.paths.last_words(self.ctx.rank), self.ctx.rank, self.ctx.hosts[self.ctx.rank],
                            f"{error}: {message}")
        except OSError as exc:
            log.warning("could not write this rank's last words: %s", exc)
        log.error("%s: %s", error, message)
        sys.stderr.write(f"hpcdist.errors.{error}: {message}\n")
        sys.stderr.flush()

    def stop(self) -> None:
        self._done.set()


def _imitate(timeout_s: float, delay_s: float) -> None:
    """What NCCL's watchdog does, for tests on CPU: once a collective has waited the timeout, abort
    the rank from a thread of its own `delay_s` later, whether or not it completed since (the
    job thread stays blocked inside it, or goes on)."""
    while (late := overdue(timeout_s, "gloo")) is None:
        time.sleep(INTERVAL_S)
    time.sleep(delay_s)
    sys.stderr.write(f"imitated watchdog: {late.op} timed out {delay_s:g} s ago; aborting the rank (SIGABRT)\n")
    sys.stderr.flush()
    os.abort()


_WATCH: list[Watch] = []


def start(ctx: JobRank, env: Mapping[str, str]) -> Watch | None:
    """Start watching this rank's collectives (once per process), where the backend ends ranks
    itself: NCCL (also for a group the user's script makes), or gloo imitating it."""
    delay = imitated(env)
    if ctx.backend != "nccl" and delay is None:
        return None
    if not _WATCH:
        _WATCH.append(Watch(ctx, delay))
        _WATCH[0].start()
        if delay is not None and ctx.backend == "gloo":
            threading.Thread(target=_imitate, args=(ctx.timeout_s, delay), name="hpcdist-imitated-watchdog",
                             daemon=True).start()
    return _WATCH[0]


def fired() -> bool:
    """Whether this rank has a collective the backend timed out (its summary written or being written)."""
    return bool(_WATCH) and _WATCH[0].fired.is_set()


def stop() -> None:
    while _WATCH:
        _WATCH.pop().stop()

"""One measurement (an operation at one size in one mode on one path) and its summary row.

Every rank runs ``measure``; rank 0 turns the gathered per-rank timings into the row that goes
into the result file: time averaged over iterations then across ranks (as nccl-tests), algbw
and busbw from it, the per-iteration p50 and p99 over all ranks' iterations, the slowest rank,
and the number of wrong elements summed over ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdist.bench import pattern
from hpcdist.bench.bandwidth import Counts, algbw, bus_factor, human_bytes
from hpcdist.bench.base import CommPath
from hpcdist.runtime import abort

# Fault injection for tests: ``RANK:OP:SIZE`` makes that rank exit when it reaches OP at SIZE.
FAULT_VAR = "HPCDIST_BENCH_FAULT_EXIT"

ROW_COLUMNS: tuple[str, ...] = (
    "size",
    "count",
    "in_place",
    "time_us",
    "algbw_gbps",
    "busbw_gbps",
    "p50_us",
    "p99_us",
    "slowest_rank",
    "slowest_host",
    "slowest_time_us",
    "wrong",
    "fraction",
)


@dataclass
class Local:
    """One rank's raw figures for one measurement."""

    times: np.ndarray  # seconds per iteration
    wrong: int

    def as_plain(self) -> dict[str, Any]:
        """As plain data, the shape it travels in to rank 0 (``hpcdist.runtime.plain``: no pickles)."""
        return {"local_times": np.asarray(self.times), "local_wrong": int(self.wrong)}

    @staticmethod
    def from_plain(value: Any) -> Any:
        """The Local `as_plain` spelled; any other value as it is (a measurement may return rows)."""
        if isinstance(value, dict) and value.keys() == {"local_times", "local_wrong"}:
            return Local(value["local_times"], value["local_wrong"])
        return value


def measure(
    path: CommPath, op: str, c: Counts, mode: str, dtype: str, warmup: int, iters: int, check: bool
) -> Local:
    """Fill the inputs, warm up, time `iters` calls, then (if `check`) refill, call once and count wrong elements.

    The inputs are written before the first call, always (as nccl-tests initialises its buffers):
    a large buffer fresh from ``zeros`` is mapped to the kernel's shared zero page until written,
    and a collective that reads it runs faster than on real data, which overstated busbw by up to
    3x against a bare loop on reused memory.
    """
    prepared = path.prepare(op, c, mode, dtype)
    prepared.fill()
    path.sync()
    for _ in range(warmup):
        prepared.step()
    path.sync()
    path.barrier()
    times = path.timed(prepared.step, iters)
    wrong = 0
    if check and op != "barrier":
        prepared.fill()
        path.sync()
        path.barrier()
        prepared.step()
        path.sync()
        out = prepared.output()
        ax = path.arrays()
        want = pattern.expected(ax, op, path.rank, path.size, c)
        if out is not None and want is not None:
            wrong = ax.count_wrong(out, want, pattern.exact_for(dtype, path.size))
    return Local(times, wrong)


def summarize(
    op: str,
    c: Counts,
    in_place: bool,
    locals_: Sequence[Local],
    ranks: Sequence[int],
    hosts: Sequence[str],
    nranks: int,
    expected_gbps: float | None,
    bytes_per_time: int | None = None,
) -> dict[str, Any]:
    """The result row from every participating rank's figures (rank 0 only)."""
    means = np.array([loc.times.mean() for loc in locals_])
    seconds = float(means.mean())
    every = np.concatenate([loc.times for loc in locals_])
    worst = int(np.argmax(means))
    moved = c.size_bytes if bytes_per_time is None else bytes_per_time
    alg = algbw(moved, seconds) if moved else float("nan")
    bus = alg * bus_factor(op, nranks) if moved else float("nan")
    return {
        "size": c.size_bytes,
        "count": c.count,
        "in_place": int(in_place),
        "time_us": seconds * 1e6,
        "algbw_gbps": alg,
        "busbw_gbps": bus,
        "p50_us": float(np.percentile(every, 50)) * 1e6,
        "p99_us": float(np.percentile(every, 99)) * 1e6,
        "slowest_rank": int(ranks[worst]),
        "slowest_host": hosts[ranks[worst]],
        "slowest_time_us": float(means[worst]) * 1e6,
        "wrong": int(sum(loc.wrong for loc in locals_)),
        "fraction": bus / expected_gbps if expected_gbps and moved else float("nan"),
    }


def maybe_fault(rank: int, op: str, size: int, log: logging.Logger, env: dict[str, str] | None = None) -> None:
    """Exit this rank if the fault-injection variable names it at this operation and size."""
    spec = (os.environ if env is None else env).get(FAULT_VAR, "")
    if not spec:
        return
    try:
        f_rank, f_op, f_size = spec.split(":")
        hit = int(f_rank) == rank and f_op == op and int(f_size) == size
    except ValueError:
        return
    if hit:
        log.error("fault injection: rank %d exits at %s size %s", rank, op, human_bytes(size))
        logging.shutdown()
        sys.stderr.flush()
        os._exit(3)


class Watchdog:
    """Ends this rank if one measurement does not finish in time.

    gloo and NCCL calls fail on their own after the process-group timeout, but an MPI call
    waiting for a dead peer never returns; without this a lost rank would hang the job until
    the scheduler's time limit. The limit is the job's timeout plus a grace period, so a
    torch.distributed timeout (a normal, catchable error) comes first. Under NCCL a timeout
    raises nothing: ``hpcdist.runtime.abort`` writes the summary at the timeout itself, and this
    watchdog then leaves the rank's end to NCCL's.
    """

    def __init__(self, timeout_s: float, log: logging.Logger, rank: int) -> None:
        self.limit = timeout_s * 1.25 + 5.0
        self.log = log
        self.rank = rank
        self.note = ""  # appended to the error, e.g. where the rows so far are
        self._what: str | None = None
        self._deadline = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="hpcdist-bench-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._lock:
            self._what, self._deadline = what, time.monotonic() + self.limit
        try:
            yield
        finally:
            with self._lock:
                self._what = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                what, late = self._what, self._what is not None and time.monotonic() > self._deadline
            if late and abort.fired():  # NCCL's watchdog ends the rank, after hpcdist's summary
                continue
            if late:
                message = (
                    f"{what} did not finish within {self.limit:.0f} s on rank {self.rank}; a peer rank died or "
                    f"hangs{self.note}"
                )
                self.log.error("benchmark: %s", message)
                logging.shutdown()
                # the line submitit's error summary picks up (`hpcdist submit --wait` shows it)
                sys.stderr.write(f"hpcdist.errors.BenchmarkError: {message}\n")
                sys.stderr.flush()
                os._exit(124)

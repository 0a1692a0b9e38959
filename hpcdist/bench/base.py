"""What the benchmarks need from a communication path (torch.distributed or MPI).

A path prepares one collective call on real buffers (``Prepared``), times a loop of calls,
sends and receives for point to point, and moves small Python objects to rank 0 for the
summary. The sweep code in ``collectives``, ``p2p`` and ``pairs`` is written once against this
interface, so the two paths are measured by the same loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hpcdist.bench.bandwidth import Counts

IN_PLACE = "in_place"
OUT_OF_PLACE = "out_of_place"
NO_BUFFER = "none"  # barrier: neither

# Which modes each path can run for each operation. torch.distributed's all_reduce, broadcast
# and reduce work on one tensor (in place only) and its all_to_all_single has no in-place
# form; MPI has MPI_IN_PLACE for every reduction and gather, and one buffer for Bcast.
MODES: dict[str, dict[str, tuple[str, ...]]] = {
    "torch": {
        "all_reduce": (IN_PLACE,),
        "all_gather": (OUT_OF_PLACE, IN_PLACE),
        "reduce_scatter": (OUT_OF_PLACE, IN_PLACE),
        "broadcast": (IN_PLACE,),
        "reduce": (IN_PLACE,),
        "all_to_all": (OUT_OF_PLACE,),
        "barrier": (NO_BUFFER,),
    },
    "mpi": {
        "all_reduce": (OUT_OF_PLACE, IN_PLACE),
        "all_gather": (OUT_OF_PLACE, IN_PLACE),
        "reduce_scatter": (OUT_OF_PLACE, IN_PLACE),
        "broadcast": (IN_PLACE,),
        "reduce": (OUT_OF_PLACE, IN_PLACE),
        "all_to_all": (OUT_OF_PLACE, IN_PLACE),
        "barrier": (NO_BUFFER,),
    },
}


def modes_for(path: str, op: str, wanted: Sequence[str]) -> list[str]:
    """The modes of `wanted` that `path` runs for `op` (barrier always runs once)."""
    have = MODES[path][op]
    if have == (NO_BUFFER,):
        return [NO_BUFFER]
    return [m for m in have if m in wanted]


@dataclass
class Prepared:
    """One collective call on allocated buffers."""

    step: Callable[[], Any]  # runs the call once, blocking until this rank's part is done
    fill: Callable[[], None]  # writes the data pattern into the inputs
    output: Callable[[], Any]  # this rank's result region (None where nothing is defined)


class Request(Protocol):
    def wait(self) -> Any: ...


class CommPath(Protocol):
    """A communication path as the benchmark loops use it."""

    name: str  # "torch" or "mpi"
    label: str  # "torch/gloo", "torch/nccl", "mpi/numpy", "mpi/cuda"
    rank: int
    size: int

    def arrays(self) -> Any: ...
    def prepare(self, op: str, c: Counts, mode: str, dtype: str) -> Prepared: ...
    def timed(self, step: Callable[[], Any], iters: int) -> np.ndarray: ...
    def sync(self) -> None: ...
    def barrier(self) -> None: ...
    def gather(self, obj: Any) -> list[Any] | None: ...
    def bcast(self, obj: Any) -> Any: ...
    def bytes_buffer(self, nbytes: int) -> Any: ...
    def send(self, buf: Any, peer: int) -> None: ...
    def recv(self, buf: Any, peer: int) -> None: ...
    def isend(self, buf: Any, peer: int) -> Request: ...
    def irecv(self, buf: Any, peer: int) -> Request: ...
    def wait_all(self, reqs: list[Any]) -> None: ...
    def exchange(self, send: Any, recv: Any, peer: int, count: int) -> None:
        """`count` receives into `recv` and `count` sends of `send` with `peer`, posted as one
        group and waited for: NCCL runs a pair's separate point-to-point calls in order on one
        stream, where receives posted before sends on both sides wait for ever."""


def host_timed(step: Callable[[], Any], iters: int) -> np.ndarray:
    """Seconds per call of a blocking `step`, one clock read per iteration.

    The loop reads the clock once between calls (not twice around each), so the sum of the
    per-iteration times is exactly the loop's wall time, as nccl-tests measures it.
    """
    stamps = np.empty(iters + 1)
    clock = time.perf_counter
    stamps[0] = clock()
    for i in range(1, iters + 1):
        step()
        stamps[i] = clock()
    return np.diff(stamps)

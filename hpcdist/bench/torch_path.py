"""The torch.distributed path: the job's default process group (NCCL on GPUs, gloo on CPUs).

Buffers live on the rank's device. On a GPU each iteration is timed with CUDA events recorded
between the calls (no synchronisation inside the loop); on the CPU the gloo calls block, so the
host clock is read between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpcdist.bench import pattern
from hpcdist.bench.bandwidth import Counts
from hpcdist.bench.base import IN_PLACE, NO_BUFFER, Prepared, host_timed
from hpcdist.runtime.plain import broadcast_plain, gather_plain

# torch 2.13 renamed the tensor forms of all_gather and reduce_scatter; older releases have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class TorchPath:
    name = "torch"

    def __init__(self, device: torch.device, backend: str) -> None:
        self.device = device
        self.backend = backend
        self.label = f"torch/{backend}"
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.cuda = device.type == "cuda"

    def arrays(self) -> pattern.Arrays:
        return pattern.Arrays("torch", self.device)

    def _empty(self, n: int, dtype: str) -> torch.Tensor:
        return torch.zeros(n, dtype=DTYPES[dtype], device=self.device)

    def prepare(self, op: str, c: Counts, mode: str, dtype: str) -> Prepared:
        ax = self.arrays()
        rank, n = self.rank, self.size
        inplace = mode == IN_PLACE

        def put(buf: torch.Tensor, start: int = 0) -> None:
            buf.copy_(pattern.values(ax, rank, start, buf.numel()))

        if mode == NO_BUFFER or op == "barrier":
            return Prepared(step=dist.barrier, fill=lambda: None, output=lambda: None)
        if op in ("all_reduce", "broadcast", "reduce"):
            buf = self._empty(c.count, dtype)
            call: Callable[[], Any] = {
                "all_reduce": lambda: dist.all_reduce(buf),
                "broadcast": lambda: dist.broadcast(buf, 0),
                "reduce": lambda: dist.reduce(buf, 0),
            }[op]
            return Prepared(call, lambda: put(buf), lambda: buf if (op != "reduce" or rank == 0) else None)
        m = c.count // n
        if op == "all_gather":
            out = self._empty(c.recv, dtype)
            src = out[rank * m : (rank + 1) * m] if inplace else self._empty(m, dtype)

            def fill_gather() -> None:
                out.zero_()
                put(src)

            return Prepared(lambda: _all_gather(out, src), fill_gather, lambda: out)
        if op == "reduce_scatter":
            src = self._empty(c.send, dtype)
            out = src[rank * m : (rank + 1) * m] if inplace else self._empty(m, dtype)
            return Prepared(lambda: _reduce_scatter(out, src), lambda: put(src), lambda: out)
        if op == "all_to_all":
            src = self._empty(c.send, dtype)
            out = self._empty(c.recv, dtype)
            return Prepared(lambda: dist.all_to_all_single(out, src), lambda: put(src), lambda: out)
        raise ValueError(f"torch path has no operation {op!r}")

    def timed(self, step: Callable[[], Any], iters: int) -> np.ndarray:
        if not self.cuda:
            return host_timed(step, iters)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(1, iters + 1):
            step()
            events[i].record()
        torch.cuda.synchronize(self.device)
        return np.array([events[i - 1].elapsed_time(events[i]) / 1e3 for i in range(1, iters + 1)])

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        dist.barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        return gather_plain(obj, dst=0, what="its figures")

    def bcast(self, obj: Any) -> Any:
        return broadcast_plain(obj, src=0)

    def bytes_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def send(self, buf: torch.Tensor, peer: int) -> None:
        dist.send(buf, peer)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        dist.recv(buf, peer)

    def isend(self, buf: torch.Tensor, peer: int) -> Any:
        return dist.isend(buf, peer)

    def irecv(self, buf: torch.Tensor, peer: int) -> Any:
        return dist.irecv(buf, peer)

    def wait_all(self, reqs: list[Any]) -> None:
        for r in reqs:
            r.wait()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, count: int) -> None:
        # one NCCL group (batch_isend_irecv): posted one by one, both sides' receives would wait
        # on the stream for sends queued behind them (NVIDIA/nccl#479)
        ops = [dist.P2POp(dist.irecv, recv, peer) for _ in range(count)]
        ops += [dist.P2POp(dist.isend, send, peer) for _ in range(count)]
        self.wait_all(dist.batch_isend_irecv(ops))

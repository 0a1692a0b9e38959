"""The MPI path: mpi4py on NumPy buffers, or on GPU buffers where the MPI is CUDA-aware.

Buffer-based calls only (``Allreduce``, ``Send``...: no pickling), with ``MPI.IN_PLACE`` for
the in-place forms. MPI calls have no timeout of their own; the sweep's watchdog ends a rank
whose call does not return in time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcdist.bench import pattern
from hpcdist.bench.bandwidth import Counts
from hpcdist.bench.base import IN_PLACE, NO_BUFFER, Prepared, host_timed
from hpcdist.bench.params import CUDA_AWARE_HINT
from hpcdist.errors import BenchmarkError

NP_DTYPES = {"float32": np.float32, "float64": np.float64, "int32": np.int32}


def cuda_refusal(mpi: Any, site_cuda_aware: bool) -> str | None:
    """Why GPU buffers must not be handed to this MPI, or None when they may: the library's own
    answer where mpi4py can ask it (``MPI.Query_cuda_support``: mpi4py 4 on an MPI that has
    ``MPIX_Query_cuda_support``), else the site's ``network.mpi_cuda_aware``. An MPI that is not
    CUDA-aware reads a device pointer as host memory and crashes or returns garbage."""
    query = getattr(mpi, "Query_cuda_support", None)
    if query is not None:
        return None if query() else ("params.mpi_buffers is 'cuda' but this MPI library is not CUDA-aware "
                                     "(MPI.Query_cuda_support() is false); use mpi_buffers: numpy")
    if site_cuda_aware:
        return None
    return ("params.mpi_buffers is 'cuda' but this MPI library cannot say whether it is CUDA-aware (mpi4py has no "
            "MPI.Query_cuda_support for it) and the site's network.mpi_cuda_aware is false; use mpi_buffers: numpy, "
            f"or {CUDA_AWARE_HINT}")


class MPIPath:
    name = "mpi"

    def __init__(self, comm: Any, buffers: str = "numpy", device: Any = None, cuda_aware: bool = False) -> None:
        """`cuda_aware`: the site's ``network.mpi_cuda_aware``, asked when the library cannot be."""
        if comm is None:
            raise BenchmarkError("the MPI path needs mpi4py's COMM_WORLD, but MPI was not initialised for this job")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.buffers = buffers
        self.device = device
        self.label = f"mpi/{buffers}"
        if buffers == "cuda" and (why := cuda_refusal(MPI, cuda_aware)):
            raise BenchmarkError(why)

    def arrays(self) -> pattern.Arrays:
        if self.buffers == "cuda":
            return pattern.Arrays("torch", self.device)
        return pattern.Arrays("numpy")

    def _empty(self, n: int, dtype: str) -> Any:
        if self.buffers == "cuda":
            import torch

            return torch.zeros(n, dtype=getattr(torch, dtype), device=self.device)
        return np.zeros(n, dtype=NP_DTYPES[dtype])

    def prepare(self, op: str, c: Counts, mode: str, dtype: str) -> Prepared:
        comm, rank, n = self.comm, self.rank, self.size
        ax = self.arrays()
        inplace = mode == IN_PLACE
        SUM, IP = MPI.SUM, MPI.IN_PLACE

        def put(buf: Any) -> None:
            buf[:] = pattern.values(ax, rank, 0, len(buf))

        if mode == NO_BUFFER or op == "barrier":
            return Prepared(step=comm.Barrier, fill=lambda: None, output=lambda: None)
        m = c.count // n
        if op == "broadcast":
            buf = self._empty(c.count, dtype)
            return Prepared(lambda: comm.Bcast(buf, 0), lambda: put(buf), lambda: buf)
        if op in ("all_reduce", "reduce"):
            recv = self._empty(c.count, dtype)
            send = recv if inplace else self._empty(c.count, dtype)
            call: Callable[[], Any]
            if op == "all_reduce":
                call = (lambda: comm.Allreduce(IP, recv, SUM)) if inplace else (lambda: comm.Allreduce(send, recv, SUM))
            elif inplace and rank == 0:
                call = lambda: comm.Reduce(IP, recv, SUM, 0)  # noqa: E731
            elif inplace:  # a non-root rank's receive buffer is not significant: do not alias it
                call = lambda: comm.Reduce(send, None, SUM, 0)  # noqa: E731
            else:
                call = lambda: comm.Reduce(send, recv, SUM, 0)  # noqa: E731
            return Prepared(call, lambda: put(send), lambda: recv if (op == "all_reduce" or rank == 0) else None)
        if op == "all_gather":
            recv = self._empty(c.recv, dtype)
            if inplace:
                mine = recv[rank * m : (rank + 1) * m]

                def fill_ip() -> None:
                    recv[:] = 0
                    put(mine)

                return Prepared(lambda: comm.Allgather(IP, recv), fill_ip, lambda: recv)
            send = self._empty(m, dtype)
            return Prepared(lambda: comm.Allgather(send, recv), lambda: put(send), lambda: recv)
        if op == "reduce_scatter":
            send = self._empty(c.send, dtype)
            if inplace:  # MPI_IN_PLACE: input is the whole receive buffer, result lands at its start
                return Prepared(lambda: comm.Reduce_scatter_block(IP, send, SUM), lambda: put(send), lambda: send[:m])
            recv = self._empty(m, dtype)
            return Prepared(lambda: comm.Reduce_scatter_block(send, recv, SUM), lambda: put(send), lambda: recv)
        if op == "all_to_all":
            recv = self._empty(c.recv, dtype)
            if inplace:
                return Prepared(lambda: comm.Alltoall(IP, recv), lambda: put(recv), lambda: recv)
            send = self._empty(c.send, dtype)
            return Prepared(lambda: comm.Alltoall(send, recv), lambda: put(send), lambda: recv)
        raise ValueError(f"MPI path has no operation {op!r}")

    def timed(self, step: Callable[[], Any], iters: int) -> np.ndarray:
        return host_timed(step, iters)

    def sync(self) -> None:
        if self.buffers == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        gathered: list[Any] | None = self.comm.gather(obj, root=0)
        return gathered

    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    def bytes_buffer(self, nbytes: int) -> Any:
        if self.buffers == "cuda":
            import torch

            return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return np.zeros(nbytes, dtype=np.uint8)

    def send(self, buf: Any, peer: int) -> None:
        self.comm.Send(buf, peer, 7)

    def recv(self, buf: Any, peer: int) -> None:
        self.comm.Recv(buf, peer, 7)

    def isend(self, buf: Any, peer: int) -> Any:
        return self.comm.Isend(buf, peer, 8)

    def irecv(self, buf: Any, peer: int) -> Any:
        return self.comm.Irecv(buf, peer, 8)

    def wait_all(self, reqs: list[Any]) -> None:
        MPI.Request.Waitall(reqs)

    def exchange(self, send: Any, recv: Any, peer: int, count: int) -> None:
        reqs = [self.irecv(recv, peer) for _ in range(count)]
        self.wait_all(reqs + [self.isend(send, peer) for _ in range(count)])

"""The smoke job: every rank joins, all-reduces its rank, checks the sum; rank 0 writes a result.

It is the first job a new user runs and the one the tests launch through every launcher, so it
also records the bootstrap timings and, when asked, checks MPI through mpi4py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from hpcdist.config.site import Frozen
from hpcdist.errors import JobError

if TYPE_CHECKING:
    from hpcdist.runtime.job_rank import JobRank


class SmokeParams(Frozen):
    mpi: bool = Field(default=False, description="also all-reduce through mpi4py")
    label: str = Field(default="", description="written to the result as is (tells a sweep's tasks apart)")

    @property
    def uses_mpi(self) -> bool:
        return self.mpi


def run(ctx: JobRank, params: SmokeParams) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    from hpcdist.runtime.plain import all_gather_plain
    from hpcdist.store.results import result_file, write_table

    value = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(value)
    expected = ctx.world_size * (ctx.world_size - 1) / 2
    if value.item() != expected:
        raise JobError(f"all_reduce of ranks gave {value.item()}, expected {expected}")
    mpi_sum = None
    if params.mpi:
        from mpi4py import MPI

        mpi_sum = ctx.mpi_comm.allreduce(ctx.rank, op=MPI.SUM)
        if mpi_sum != expected:
            raise JobError(f"MPI allreduce of ranks gave {mpi_sum}, expected {expected}")
    timings: list[dict[str, float]] = all_gather_plain(ctx.timings, what="its start-up timings")
    out: dict[str, Any] = {"sum": value.item(), "mpi_sum": mpi_sum}
    if ctx.is_main:
        path = ctx.result_path()
        with result_file(path, ctx.run_attrs()) as f:
            f.attrs["sum"] = value.item()
            f.attrs["expected_sum"] = expected
            f.attrs["mpi_sum"] = -1 if mpi_sum is None else mpi_sum
            f.attrs["label"] = params.label
            names = sorted({k for t in timings for k in t})
            cols: dict[str, Any] = {"rank": np.arange(ctx.world_size), "host": list(ctx.hosts)}
            cols.update({f"{n}_s": np.array([t.get(n, np.nan) for t in timings]) for n in names})
            write_table(f, "bootstrap", cols)
        out["result"] = str(path)
    return out


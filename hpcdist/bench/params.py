"""The benchmark job kinds and their parameters: ``bench_collectives``, ``bench_p2p``,
``bench_pairs`` and ``bench_preflight``.

Light on purpose (pydantic and the factor table only): the login node validates a spec with
this module, and every problem a site can know of (an MPI path without mpi4py or without an MPI
launcher, GPU buffers without GPUs, a mode no path can run) is reported before anything
launches.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from hpcdist.bench.bandwidth import COLLECTIVES, P2P_TESTS, parse_size, sweep
from hpcdist.config.site import Frozen

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.kinds.registry import Job, Problem

Size = Annotated[int, BeforeValidator(parse_size)]
# What to do when GPU buffers meet an MPI the site does not call CUDA-aware (here and at run time, mpi_path).
CUDA_AWARE_HINT = ("set network.mpi_cuda_aware: true in the site config if the nodes' MPI is built with CUDA support "
                   "(Open MPI: ompi_info --parsable --all | grep mpi_built_with_cuda_support:value)")
Op = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "barrier"]
PathName = Literal["torch", "mpi"]
Mode = Literal["out_of_place", "in_place"]
Test = Literal["pingpong", "unidir", "bidir"]
DType = Literal["float32", "float64", "int32", "float16", "bfloat16"]
assert set(Op.__args__) == set(COLLECTIVES) and set(Test.__args__) == set(P2P_TESTS)  # type: ignore[attr-defined]


class _Params(Frozen):
    paths: tuple[PathName, ...] = Field(default=("torch",), min_length=1,
                                        description="torch (NCCL on GPUs, gloo on CPUs) and/or mpi (mpi4py)")
    mpi_buffers: Literal["numpy", "cuda"] = Field(default="numpy", description="where the MPI path's buffers live")
    warmup: int = Field(default=5, ge=0)
    iters: int = Field(default=20, ge=1)
    enforce_minimums: bool = Field(default=True, description="fail the job below the site's baselines minimums")

    @property
    def uses_mpi(self) -> bool:
        return "mpi" in self.paths

    @model_validator(mode="after")
    def _unique_paths(self) -> Any:
        if len(set(self.paths)) != len(self.paths):
            raise ValueError(f"paths: {list(self.paths)} names a path twice")
        return self


class _Sweep(_Params):
    min_bytes: Size = Field(default=8, description="first size of the sweep (nccl-tests -b)")
    max_bytes: Size = Field(default=64 << 20, description="last size (nccl-tests -e)")
    factor: int | None = Field(default=2, description="multiply by this between sizes (nccl-tests -f)")
    step_bytes: Size | None = Field(default=None, description="or add this between sizes (nccl-tests -i)")
    check: bool = Field(default=True, description="check the data of every size and count wrong elements")

    @model_validator(mode="after")
    def _sizes(self) -> Any:
        if self.min_bytes <= 0:
            raise ValueError(f"min_bytes must be a positive size, got {self.min_bytes}")
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive size, got {self.max_bytes}")
        if self.max_bytes < self.min_bytes:
            raise ValueError(f"max_bytes {self.max_bytes} is below min_bytes {self.min_bytes}; swap them")
        if self.step_bytes is not None and self.step_bytes <= 0:
            raise ValueError(f"step_bytes must be a positive size, got {self.step_bytes}")
        if self.step_bytes is None and (self.factor is None or self.factor < 2):
            raise ValueError(f"factor must be an integer >= 2 (or set step_bytes), got {self.factor}")
        if len(self.sizes()) > 200:
            raise ValueError(f"the sweep has {len(self.sizes())} sizes; use a larger factor or step (at most 200)")
        return self

    def sizes(self) -> list[int]:
        return sweep(self.min_bytes, self.max_bytes, self.factor, self.step_bytes)


class CollectivesParams(_Sweep):
    ops: tuple[Op, ...] = Field(default=COLLECTIVES, min_length=1)  # type: ignore[arg-type]
    modes: tuple[Mode, ...] = Field(default=("out_of_place", "in_place"), min_length=1)
    dtype: DType = "float32"


class P2PParams(_Sweep):
    tests: tuple[Test, ...] = Field(default=P2P_TESTS, min_length=1)  # type: ignore[arg-type]
    window: int = Field(default=16, ge=1, le=256, description="messages in flight per iteration (unidir, bidir)")
    ranks: tuple[int, int] | None = Field(default=None, description="the two ranks; default first and last")

    @model_validator(mode="after")
    def _two_ranks(self) -> Any:
        if self.ranks is not None and (self.ranks[0] == self.ranks[1] or min(self.ranks) < 0):
            raise ValueError(f"ranks must be two different ranks >= 0, got {list(self.ranks)}")
        return self


class PairsParams(_Params):
    size: Size = Field(default=4 << 20, gt=0, description="message size of the bandwidth cells")
    latency_size: Size = Field(default=8, gt=0, description="message size of the latency cells")
    window: int = Field(default=16, ge=1, le=256)
    iters: int = Field(default=10, ge=1)
    warmup: int = Field(default=2, ge=0)


class PreflightParams(_Params):
    """A check that takes seconds: all_reduce at a few sizes, then the node pairs."""

    sizes_bytes: tuple[Size, ...] = Field(default=(1 << 20, 16 << 20), min_length=1)
    pair_size: Size = Field(default=4 << 20, gt=0)
    latency_size: Size = Field(default=8, gt=0)
    window: int = Field(default=8, ge=1, le=256)
    iters: int = Field(default=10, ge=1)
    warmup: int = Field(default=2, ge=0)
    dtype: DType = "float32"
    check: bool = True
    on_slow: Literal["stop", "continue"] = Field(
        default="stop", description="below a minimum: stop the job (resubmit: the marked nodes are excluded), or go on"
    )

    @model_validator(mode="after")
    def _positive(self) -> Any:
        bad = [s for s in self.sizes_bytes if s <= 0]
        if bad:
            raise ValueError(f"sizes_bytes must be positive sizes, got {bad[0]}")
        return self


# ---- checks against the site, before anything launches

def _paths_problems(job: Job[Any], site: Site) -> list[Problem]:
    spec, p = job.spec, job.params
    out: list[Problem] = []
    gpus = spec.resources.gpus_per_node
    if "mpi" in p.paths:
        if importlib.util.find_spec("mpi4py") is None:
            out.append(
                ("params.paths", "mpi", "mpi4py is not installed: pip install 'hpcdist[mpi]', or use path torch")
            )
        under_mpi = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
        if site.scheduler == "local" and spec.resources.world_size > 1 and not under_mpi:
            out.append((
                "params.paths", "mpi",
                "this site starts ranks without an MPI launcher; use a Slurm site (srun --mpi=pmix) or path torch",
            ))
        if p.mpi_buffers == "cuda" and gpus == 0:
            out.append(("params.mpi_buffers", "cuda", "GPU buffers need resources.gpus_per_node > 0; use numpy"))
        elif p.mpi_buffers == "cuda" and not site.network.mpi_cuda_aware:
            out.append(("params.mpi_buffers", "cuda", f"the site's MPI is not CUDA-aware (network.mpi_cuda_aware is "
                        f"false); use numpy, or {CUDA_AWARE_HINT}"))
        dtype = getattr(p, "dtype", "float32")
        if dtype in ("float16", "bfloat16"):
            out.append(("params.dtype", dtype, "MPI has no half-precision type; use float32, float64 or int32"))
    elif p.mpi_buffers == "cuda":
        out.append(("params.mpi_buffers", "cuda", "only the mpi path uses it; add mpi to params.paths"))
    if "torch" in p.paths and spec.backend == "nccl" and gpus == 0:
        out.append(("backend", "nccl", "NCCL needs GPUs: set resources.gpus_per_node, or use backend gloo"))
    return out


def _baseline_problems(site: Site) -> list[Problem]:
    out: list[Problem] = []
    for key in ("min_busbw_gbps", "expected_busbw_gbps"):
        for op in getattr(site.baselines, key):
            if op not in COLLECTIVES:
                out.append((f"site baselines.{key}.{op}", op, f"name one of {', '.join(COLLECTIVES)}"))
    for op, floors in site.baselines.min_busbw_gbps.items():
        for size in floors if isinstance(floors, dict) else ():
            try:
                parse_size(size)
            except ValueError:
                out.append((f"site baselines.min_busbw_gbps.{op}.{size}", size, "key a message size: 16M, 8G, 1048576"))
    return out


def check_collectives(job: Job[CollectivesParams], site: Site) -> list[Problem]:
    from hpcdist.bench.base import MODES, NO_BUFFER  # numpy: only when such a spec is checked

    p = job.params
    out = _paths_problems(job, site) + _baseline_problems(site)
    for path in p.paths:
        for op in p.ops:
            have = MODES[path][op]
            if have != (NO_BUFFER,) and not set(have) & set(p.modes):
                out.append((
                    "params.modes", list(p.modes),
                    f"{op} on path {path} runs only {', '.join(have)}; add it to params.modes or drop {op}",
                ))
    return out


def check_p2p(job: Job[P2PParams], site: Site) -> list[Problem]:
    spec, p = job.spec, job.params
    out = _paths_problems(job, site) + _baseline_problems(site)
    world = spec.resources.world_size
    if world < 2:
        out.append(("resources", world, "point to point needs at least 2 ranks (nodes x tasks_per_node)"))
    if p.ranks is not None and max(p.ranks) >= world:
        out.append(("params.ranks", list(p.ranks), f"ranks below the world size {world}"))
    return out


def check_pairs(job: Job[PairsParams], site: Site) -> list[Problem]:
    spec = job.spec
    out = _paths_problems(job, site) + _baseline_problems(site)
    if spec.resources.nodes < 2:
        out.append(("resources.nodes", spec.resources.nodes, "a node-pair matrix needs at least 2 nodes"))
    return out


def check_preflight(job: Job[PreflightParams], site: Site) -> list[Problem]:
    spec = job.spec
    out = _paths_problems(job, site) + _baseline_problems(site)
    if spec.resources.world_size < 2:
        out.append(("resources", spec.resources.world_size, "a preflight needs at least 2 ranks"))
    return out


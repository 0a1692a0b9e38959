"""Rank 0's weights to every rank in large flat buckets (not one broadcast per tensor).

Small tensors (biases, layer norms) would each pay a collective's latency; packing tensors
into contiguous buckets of ``bucket_bytes`` (the idea of DDP's gradient buckets) makes the
transfer bandwidth-bound. The other ranks learn the names, shapes and dtypes from a small
object broadcast first, so they need no checkpoint and no model config to receive.

Bandwidth is nccl-tests' arithmetic from the one factor table, ``hpcdist.bench.factors``
(importing it loads nothing of the benchmark package but that module: no torch, no MPI).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hpcdist.bench.factors import algbw, busbw

Meta = list[tuple[str, tuple[int, ...], str]]  # name, shape, dtype


@dataclass(frozen=True)
class BroadcastStats:
    """One transfer of a state from one rank to `ranks` ranks."""

    bytes: int
    seconds: float
    buckets: int
    tensors: int
    ranks: int

    @property
    def algbw_gbps(self) -> float:
        return algbw(self.bytes, self.seconds)

    @property
    def busbw_gbps(self) -> float:
        return busbw("broadcast", self.bytes, self.seconds, self.ranks)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "bytes": self.bytes,
            "seconds": self.seconds,
            "buckets": self.buckets,
            "tensors": self.tensors,
            "algbw_gbps": self.algbw_gbps,
            "busbw_gbps": self.busbw_gbps,
        }


def plan_buckets(meta: Meta, bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes` (a bigger tensor goes alone).

    `bucket_bytes` <= 0 gives one bucket per tensor, the tensor-by-tensor baseline.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(meta):
        n = _nbytes(shape, dtype)
        if current and (bucket_bytes <= 0 or size + n > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def describe(state: dict[str, torch.Tensor]) -> Meta:
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]


def broadcast_state(
    state: dict[str, torch.Tensor] | None,
    device: torch.device,
    bucket_bytes: int = 64 << 20,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    meta: Meta | None = None,
) -> tuple[dict[str, torch.Tensor], BroadcastStats]:
    """Every rank gets `src`'s `state` (others pass None); returns it and the transfer's figures.

    Tensors of one dtype share a bucket; on the receiving side each tensor is a view into its
    bucket (no copy). Pass `meta` (identical on every rank) to skip the object broadcast, as a
    repeated benchmark does.
    """
    is_src = dist.get_rank() == src
    if meta is None:
        box: list[Meta | None] = [describe(state) if is_src and state is not None else None]
        dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
        meta = box[0]
        assert meta is not None
    buckets = plan_buckets(meta, bucket_bytes)
    out: dict[str, torch.Tensor] = {}
    total = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for bucket in buckets:
        dtypes = {meta[i][2] for i in bucket}
        for dtype in sorted(dtypes):  # one flat buffer per dtype (the checkpoint is all float32)
            idx = [i for i in bucket if meta[i][2] == dtype]
            numels = [_numel(meta[i][1]) for i in idx]
            if is_src:
                assert state is not None
                flat = torch.cat([state[meta[i][0]].reshape(-1).to(device) for i in idx])
            else:
                flat = torch.empty(sum(numels), dtype=getattr(torch, dtype), device=device)
            dist.broadcast(flat, src=src, group=group)
            total += flat.numel() * flat.element_size()
            for i, part in zip(idx, flat.split(numels), strict=True):
                out[meta[i][0]] = part.view(meta[i][1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    stats = BroadcastStats(total, seconds, len(buckets), len(meta), dist.get_world_size(group))
    return out, stats


@dataclass(frozen=True)
class IterationFigures:
    """A repeated broadcast's figures per timed iteration, as nccl-tests computes them: each
    iteration's time averaged across ranks, then algbw and busbw of that mean time."""

    times: list[float]
    algbw_gbps: list[float]
    busbw_gbps: list[float]

    @property
    def busbw_median_gbps(self) -> float:
        return float(np.median(self.busbw_gbps))


def iteration_figures(nbytes: int, rank_times: list[list[float]]) -> IterationFigures:
    """Figures of `nbytes` broadcast in iterations timed on every rank (`rank_times[rank][iteration]`)."""
    nranks = len(rank_times)
    times = [float(np.mean(one_iteration)) for one_iteration in zip(*rank_times, strict=True)]
    return IterationFigures(
        times,
        [algbw(nbytes, t) for t in times],
        [busbw("broadcast", nbytes, t, nranks) for t in times],
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

"""Rank 0's weights to every rank as one flat buffer, sent in buckets that overlap the packing.

Every rank lays the state out the same way in one byte buffer (`layout`: tensors in order, each
at a 64-byte aligned offset). Rank 0 copies tensors into it bucket by bucket and starts each
bucket's broadcast as soon as it is packed, so packing the next one overlaps the transfer; the
other ranks receive straight into the buffer and get their tensors as views of it: no per-tensor
allocation and no unpacking copy. A caller that repeats the transfer passes the buffer back in
(`buffer=`), as a benchmark's single-buffer peer does. Small tensors (biases, layer norms) share
a bucket so they do not each pay a collective's latency; ``bucket_bytes`` <= 0 sends tensor by
tensor (the baseline). The other ranks learn names, shapes and dtypes from a small object
broadcast first, so they need no checkpoint and no model config to receive.

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
ALIGN = 64  # bytes: each tensor's offset in the flat buffer, so any dtype can view its part


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


def layout(meta: Meta) -> tuple[list[int], int]:
    """Each tensor's byte offset in the flat buffer, and the buffer's size."""
    offsets = []
    end = 0
    for _, shape, dtype in meta:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + _nbytes(shape, dtype)
    return offsets, end


def flat_buffer(meta: Meta, device: torch.device) -> torch.Tensor:
    """A byte buffer that `broadcast_state(..., buffer=)` fills, for a caller that repeats the transfer.

    Allocate it once: touching fresh pages costs more than the transfer on a virtual machine
    (a one-shot load pays it once; huge-page advice did not help in the benchmark here).
    """
    return torch.empty(layout(meta)[1], dtype=torch.uint8, device=device)


def _views(meta: Meta, buffer: torch.Tensor) -> list[torch.Tensor]:
    offsets, _ = layout(meta)
    return [
        buffer[off : off + _nbytes(shape, dtype)].view(getattr(torch, dtype)).view(shape)
        for off, (_, shape, dtype) in zip(offsets, meta, strict=True)
    ]


def in_buffer(state: dict[str, torch.Tensor], meta: Meta, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """`state` copied into `buffer` in `layout(meta)`, as views; a source laid out so is sent without packing."""
    views = _views(meta, buffer)
    for (name, shape, _), view in zip(meta, views, strict=True):
        view.copy_(state[name].detach().reshape(shape))
    return {name: view for (name, _, _), view in zip(meta, views, strict=True)}


def broadcast_state(
    state: dict[str, torch.Tensor] | None,
    device: torch.device,
    bucket_bytes: int = 64 << 20,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    meta: Meta | None = None,
    buffer: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], BroadcastStats]:
    """Every rank gets `src`'s `state` (others pass None); returns it and the transfer's figures.

    The returned tensors are views of one flat byte buffer on `device` (on `src` too), `buffer`
    when given (`flat_buffer(meta, device)`, reused across calls). Pass `meta` (identical on
    every rank) to skip the object broadcast, as a repeated benchmark does.
    """
    is_src = dist.get_rank() == src
    if meta is None:
        box: list[Meta | None] = [describe(state) if is_src and state is not None else None]
        dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
        meta = box[0]
        assert meta is not None
    offsets, total = layout(meta)
    if buffer is None:
        buffer = flat_buffer(meta, device)
    elif buffer.numel() < total or buffer.dtype != torch.uint8 or buffer.device != device:
        raise ValueError(f"broadcast buffer of {buffer.numel()} {buffer.dtype} on {buffer.device} cannot hold "
                         f"{total} bytes on {device}; make it with flat_buffer(meta, device)")
    views = _views(meta, buffer)
    buckets = plan_buckets(meta, bucket_bytes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    works = []
    for bucket in buckets:
        if is_src:
            assert state is not None
            for i in bucket:
                source = state[meta[i][0]]
                if source.data_ptr() != views[i].data_ptr():  # already in place: nothing to pack
                    views[i].copy_(source.detach().reshape(meta[i][1]))
        first, last = bucket[0], bucket[-1]
        span = buffer[offsets[first] : offsets[last] + views[last].numel() * views[last].element_size()]
        works.append(dist.broadcast(span, src=src, group=group, async_op=True))  # goes while the next is packed
    for work in works:
        assert work is not None
        work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    out = {name: view for (name, _, _), view in zip(meta, views, strict=True)}
    payload = sum(v.numel() * v.element_size() for v in views)
    stats = BroadcastStats(payload, seconds, len(buckets), len(meta), dist.get_world_size(group))
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

"""Rank 0's weights to every rank, received into one flat buffer, sent with no copy where it can be.

Every rank lays the state out the same way in one byte buffer (`layout`: the tensors from the
biggest to the smallest, each at a 64-byte aligned offset). The other ranks receive straight into
it and get their tensors as views of it: no per-tensor allocation and no unpacking copy. Rank 0
sends a big tensor (`direct_bytes`) from its own storage in a broadcast of its own, and copies
only the small ones (biases, layer norms), which lie together, into one shared bucket (or a few),
so they do not each pay a collective's cost; a state already laid out in the buffer (`in_buffer`)
is sent as it lies, with nothing packed. Packing every byte on rank 0 cost it about as much CPU
as the transfer itself, and on two busy cores that did not overlap the sending. Every broadcast
is started at once (async), the big tensors' first, while rank 0 packs the small ones; they run
on the backend's threads. A caller that repeats the transfer passes the buffer back in (`buffer=`):
touching a fresh buffer's pages costs about half the transfer time on a virtual machine.
``bucket_bytes`` <= 0 sends tensor by tensor (the baseline). The other ranks learn names, shapes
and dtypes from a small object broadcast first (or `meta=`), so they need no checkpoint and no
model config to receive, and the buckets from rank 0 in one small broadcast.

Bandwidth is nccl-tests' arithmetic from the one factor table, ``hpcdist.bench.bandwidth``
(importing it loads nothing of the benchmark package but that module: no torch, no MPI).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hpcdist.bench.bandwidth import algbw, busbw
from hpcdist.runtime.plain import broadcast_plain

Meta = list[tuple[str, tuple[int, ...], str]]  # name, shape, dtype
ALIGN = 64  # bytes: each tensor's offset in the flat buffer, so any dtype can view its part
# A tensor at least this big goes alone, from the source's own storage: copying it into a bucket
# would cost more than one more collective. On gloo here a collective costs 0.15-0.35 ms and rank
# 0 copies at 5.5-8 GB/s (`benchmarks/infer_broadcast.py --profile`): they tie near 1-2.5 MB. With
# the small tensors together (`buffer_order`) GPT-2 small goes in 51 broadcasts with 0.5 MB copied
# (74 with 32 MB copied at 4 MiB with them in between); from 1 to 4 MiB measured alike.
DIRECT_BYTES = 1 << 20
# On a GPU the size it had before, not measured (no two GPUs here): a device copy runs at 3x NVLink
# and 20x InfiniBand and an NCCL call costs 10-30 us, which would put it near 10-45 MB there
# (docs/performance.md, "Weight broadcast from rank 0").
DIRECT_BYTES_GPU = 4 << 20


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


def plan_buckets(meta: Meta, bucket_bytes: int, alone: list[bool] | None = None) -> list[list[int]]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes` (a bigger tensor goes
    alone); a tensor marked in `alone` is a bucket of its own (the source sends it as it lies).

    `bucket_bytes` <= 0 gives one bucket per tensor, the tensor-by-tensor baseline.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(meta):
        n = _nbytes(shape, dtype)
        single = alone is not None and (alone[i] or (i > 0 and alone[i - 1]))
        if current and (bucket_bytes <= 0 or size + n > bucket_bytes or single):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def _sendable(tensor: torch.Tensor, shape: tuple[int, ...], dtype: str, device: torch.device) -> bool:
    """Whether the source can send `tensor` as it lies: contiguous, on `device`, the layout's dtype and size."""
    return (tensor.is_contiguous() and tensor.device == device and tensor.dtype == getattr(torch, dtype)
            and tensor.numel() == _numel(shape))


def _source_plan(
    state: dict[str, torch.Tensor], meta: Meta, order: list[int], sizes: list[int], offsets: list[int],
    device: torch.device, buffer: torch.Tensor | None, bucket_bytes: int,
) -> list[list[int]]:
    """The source's buckets, as positions in `order` (the buffer's): a big tensor (`direct_bytes`)
    that it can send from its own storage goes alone; tensors already in place in `buffer` and
    small ones share buckets."""
    direct = direct_bytes(device)
    alone = []
    for i in order:
        name, shape, dtype = meta[i]
        t = state[name]
        placed = buffer is not None and t.data_ptr() == buffer.data_ptr() + offsets[i]
        alone.append(sizes[i] >= direct and not placed and _sendable(t, shape, dtype, device))
    return plan_buckets([meta[i] for i in order], bucket_bytes, alone)


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return _numel(shape) * getattr(torch, dtype).itemsize


def describe(state: dict[str, torch.Tensor]) -> Meta:
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]


def direct_bytes(device: torch.device) -> int:
    """The size from which rank 0 sends a tensor alone, as it lies, on `device`."""
    return DIRECT_BYTES if device.type == "cpu" else DIRECT_BYTES_GPU


def buffer_order(meta: Meta) -> list[int]:
    """The tensors' indices in the flat buffer's order: from the biggest to the smallest (equal
    sizes in `meta`'s order). Whatever the threshold, the small tensors lie together, so rank 0
    packs them into one or a few buckets (not one between each pair of big tensors), and the big
    ones, which go as they lie, are sent first while rank 0 packs the small ones."""
    sizes = [_nbytes(shape, dtype) for _, shape, dtype in meta]
    return sorted(range(len(meta)), key=lambda i: -sizes[i])


def layout(meta: Meta) -> tuple[list[int], int]:
    """Each tensor's byte offset in the flat buffer (in `buffer_order`), and the buffer's size."""
    offsets = [0] * len(meta)
    end = 0
    for i in buffer_order(meta):
        _, shape, dtype = meta[i]
        start = -(-end // ALIGN) * ALIGN
        offsets[i] = start
        end = start + _nbytes(shape, dtype)
    return offsets, end


def flat_buffer(meta: Meta, device: torch.device) -> torch.Tensor:
    """A byte buffer that `broadcast_state(..., buffer=)` fills, for a caller that repeats the transfer.

    Allocate it once: touching fresh pages costs about half the transfer on a virtual machine
    (a one-shot load pays it once; huge-page advice did not help in the benchmark here).
    """
    return torch.empty(layout(meta)[1], dtype=torch.uint8, device=device)


def _views(meta: Meta, buffer: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    """Each tensor of `meta` as a view of `buffer` at its offset; one dtype view of the buffer per
    dtype, then a slice each (a few microseconds per tensor: it runs while the bytes arrive)."""
    typed: dict[str, torch.Tensor] = {}
    out = []
    for off, (_, shape, dtype) in zip(offsets, meta, strict=True):
        if dtype not in typed:
            size = getattr(torch, dtype).itemsize
            typed[dtype] = buffer[: buffer.numel() // size * size].view(getattr(torch, dtype))
        whole = typed[dtype]
        first = off // whole.element_size()
        out.append(whole[first : first + _numel(shape)].view(shape))
    return out


def in_buffer(state: dict[str, torch.Tensor], meta: Meta, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """`state` copied into `buffer` in `layout(meta)`, as views; a source laid out so is sent without packing."""
    views = _views(meta, buffer, layout(meta)[0])
    for (name, shape, _), view in zip(meta, views, strict=True):
        view.copy_(state[name].detach().reshape(shape))
    return {name: view for (name, _, _), view in zip(meta, views, strict=True)}


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat byte tensor (a view: no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def _source_span(
    state: dict[str, torch.Tensor], meta: Meta, bucket: list[int], offsets: list[int], sizes: list[int],
    device: torch.device, buffer: torch.Tensor | None, out: dict[str, torch.Tensor],
) -> torch.Tensor:
    """On the source: the bytes of `bucket` to broadcast, and its tensors into `out`. A tensor alone
    in its bucket goes from its own storage, a bucket already in place in `buffer` as it lies; only
    the others are copied (into `buffer`, or a bucket-sized allocation without one)."""
    sources = [state[meta[i][0]].detach() for i in bucket]
    sendable = [_sendable(t, meta[i][1], meta[i][2], device) for t, i in zip(sources, bucket, strict=True)]
    if len(bucket) == 1 and sendable[0]:
        out[meta[bucket[0]][0]] = sources[0].reshape(meta[bucket[0]][1])
        return _bytes_of(sources[0])
    base, end = offsets[bucket[0]], offsets[bucket[-1]] + sizes[bucket[-1]]
    span = buffer[base:end] if buffer is not None else torch.empty(end - base, dtype=torch.uint8, device=device)
    views = _views([meta[i] for i in bucket], span, [offsets[i] - base for i in bucket])
    for view, t, i, ok in zip(views, sources, bucket, sendable, strict=True):
        if ok and t.data_ptr() == view.data_ptr():  # already in place: nothing to pack
            out[meta[i][0]] = t.reshape(meta[i][1])
        else:
            view.copy_(t.reshape(meta[i][1]))
            out[meta[i][0]] = view
    return span


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

    On the other ranks the returned tensors are views of one flat byte buffer on `device`,
    `buffer` when given (`flat_buffer(meta, device)`, reused across calls). On `src` they are its
    own tensors, or views of the bytes it packed where it had to copy them (small tensors, or ones
    not contiguous or not on `device`). Pass `meta` (identical on every rank) to skip the object
    broadcast, as a repeated benchmark does.
    """
    is_src = dist.get_rank() == src
    if meta is None:
        meta = broadcast_plain(describe(state) if is_src and state is not None else None, src=src, group=group,
                               device=device if device.type == "cuda" else None, what="the state's layout")
        assert meta is not None
    offsets, total = layout(meta)
    if buffer is not None and (buffer.numel() < total or buffer.dtype != torch.uint8 or buffer.device != device):
        raise ValueError(f"broadcast buffer of {buffer.numel()} {buffer.dtype} on {buffer.device} cannot hold "
                         f"{total} bytes on {device}; make it with flat_buffer(meta, device)")
    if buffer is None and not is_src:
        buffer = flat_buffer(meta, device)
    sizes = [_nbytes(shape, dtype) for _, shape, dtype in meta]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    # The source alone knows which tensors are in place or big enough to go as they lie: it
    # decides the buckets and tells the others in one small broadcast (a 1 where a bucket starts,
    # in the buffer's order); a bucket is a run of tensors that lie one after the other there.
    order = buffer_order(meta)
    starts = torch.zeros(len(meta), dtype=torch.uint8, device=device)
    if is_src:
        assert state is not None
        plan = _source_plan(state, meta, order, sizes, offsets, device, buffer, bucket_bytes)
        starts[[b[0] for b in plan]] = 1
    # the source does not wait for the plan to arrive before it starts sending (a round trip less)
    works = [dist.broadcast(starts, src=src, group=group, async_op=is_src)]
    first = [i for i, v in enumerate(starts.tolist()) if v]
    buckets = [order[a:b] for a, b in zip(first, [*first[1:], len(meta)], strict=True)]
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:  # every broadcast starts at once; the source packs the next while one goes
        if is_src:
            assert state is not None
            span = _source_span(state, meta, bucket, offsets, sizes, device, buffer, out)
        else:
            assert buffer is not None
            span = buffer[offsets[bucket[0]] : offsets[bucket[-1]] + sizes[bucket[-1]]]
        works.append(dist.broadcast(span, src=src, group=group, async_op=True))
    if not is_src:  # made while the bytes arrive
        assert buffer is not None
        out = {name: view for (name, _, _), view in zip(meta, _views(meta, buffer, offsets), strict=True)}
    for work in works:
        if work is not None:  # (None: the receivers' plan, received before)
            work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    stats = BroadcastStats(sum(sizes), seconds, len(buckets), len(meta), dist.get_world_size(group))
    return {name: out[name] for name, _, _ in meta}, stats


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

"""Rank 0's weights to every rank in large flat buckets (not one broadcast per tensor).

Small tensors (biases, layer norms) would each pay a collective's latency; packing tensors
into contiguous buckets of ``bucket_bytes`` (the idea of DDP's gradient buckets) makes the
transfer bandwidth-bound. The other ranks learn the names, shapes and dtypes from a small
object broadcast first, so they need no checkpoint and no model config to receive.

Bandwidth follows nccl-tests: algbw = bytes / 1e9 / seconds; busbw = algbw for a broadcast
(factor 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

Meta = list[tuple[str, tuple[int, ...], str]]  # name, shape, dtype


@dataclass(frozen=True)
class BroadcastStats:
    bytes: int
    seconds: float
    buckets: int
    tensors: int

    @property
    def algbw_gbps(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("nan")

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps  # broadcast's bus factor is 1 (nccl-tests PERFORMANCE.md)

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
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()


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
    return out, BroadcastStats(bytes=total, seconds=seconds, buckets=len(buckets), tensors=len(meta))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

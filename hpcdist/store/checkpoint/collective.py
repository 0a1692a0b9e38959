"""Small collectives of a checkpoint's process group, sent as tensors (no rank unpickles what
another sent): every rank's outcome of a step (`agree`), every rank's text (`gather_text`), and
which ranks share this rank's host (`local_ranks`). A group that fails or times out is one
CheckpointError naming the operation."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from hpcdist.errors import CheckpointError

TEXT_BYTES = 1024  # a rank's outcome as the ranks agree on it: its status and its message


def local_ranks(group: Any) -> tuple[int, ...]:
    """The ranks of `group` on this host (its name and boot id), ascending; a collective."""
    import torch
    import xxhash

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    key = int(np.uint64(xxhash.xxh3_64_intdigest(f"{socket.gethostname()}\0{boot}".encode())).view(np.int64))
    keys = gather(group, torch.tensor([key], dtype=torch.int64), "finding the ranks of each host")
    return tuple(r for r, k in enumerate(keys) if int(k.item()) == key)


def gather(group: Any, tensor: Any, what: str) -> list[Any]:
    """Every rank's `tensor` (the same shape and dtype on all), on every rank."""
    import torch
    import torch.distributed as dist

    every = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(every, tensor, group=group)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"rank {dist.get_rank(group)}: {what}: another rank did not answer within the "
                              f"checkpoint I/O budget, or is gone ({first})") from exc
    return every


def gather_text(group: Any, text: str, what: str) -> list[str]:
    """Every rank's `text` (any length), on every rank: its length, then its UTF-8 bytes padded
    to the longest (two ``all_gather``s of tensors; no pickle)."""
    import torch

    raw = text.encode()
    sizes = [int(n.item()) for n in gather(group, torch.tensor([len(raw)], dtype=torch.int64), what)]
    mine = torch.zeros(max(1, *sizes), dtype=torch.uint8)  # gloo gathers no empty tensor
    if raw:
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return [bytes(t[:n].numpy()).decode() for t, n in zip(gather(group, mine, what), sizes, strict=True)]


def agree(group: Any, status: int, message: str, what: str) -> list[tuple[int, str]]:
    """Every rank's (status, message), on every rank."""
    if group is None:
        return [(status, message)]
    import torch

    raw = message.encode()[:TEXT_BYTES - 8]
    mine = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    mine[:8] = torch.tensor([status], dtype=torch.int64).view(torch.uint8)
    if raw:
        mine[8:8 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = []
    for t in gather(group, mine, what):
        code = int(t[:8].view(torch.int64).item())
        out.append((code, bytes(t[8:].numpy()).rstrip(b"\0").decode(errors="replace")))
    return out

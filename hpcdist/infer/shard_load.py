"""What each tensor-parallel rank holds of each checkpoint tensor, and reading just that from the file.

Megatron-style split of a block across ``tp`` ranks:

- ``attn.c_attn`` (column-parallel): rank r keeps the rows of its query heads, and of its KV
  heads in k and v: its share of them when ``tp`` divides ``n_kv_head``, else (``tp`` a multiple
  of it) the one KV head its query heads read, replicated on ``tp / n_kv_head`` ranks;
- ``attn.c_proj`` (row-parallel): rank r keeps the input columns of its heads; the bias stays
  whole (added once, after the all-reduce);
- ``mlp.c_fc`` (column-parallel): rank r keeps its slice of the hidden units (for SwiGLU, the
  same slice of the gate and of the up projection);
- ``mlp.c_proj`` (row-parallel): the matching input columns; bias whole;
- embeddings and norms are replicated (the vocab-parallel head slices a tied ``wte`` in memory);
  an untied ``lm_head`` is split by vocabulary rows.

The same plan slices an in-memory state (after a broadcast) and an HDF5 dataset (shard reads),
so both paths give the same tensors on each rank, in the checkpoint's dtype (bfloat16 read as
its bits and viewed as bfloat16, as the store does: `hpcdist.store.checkpoint.tree.typed`). From a sharded
checkpoint (FSDP's) the plan's slices are read from the saved chunks they overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdist.model.checkpoint import MODEL_GROUP, CheckpointHeader
from hpcdist.model.config import GPTConfig
from hpcdist.store import checksum, hostmem
from hpcdist.store.checkpoint.tree import as_tensor, typed

Ranges = list[tuple[int, int]]


def check_tp(cfg: GPTConfig, tp: int) -> list[tuple[str, int, str]]:
    """Why `cfg` cannot be split over `tp` ranks, as (what, value, what to do); empty when it can."""
    problems = []
    kv = cfg.n_kv
    if tp < 1:
        problems.append(("tp", tp, "must be at least 1"))
    elif cfg.n_head % tp:
        problems.append(("tp", tp, f"must divide the model's n_head={cfg.n_head} (attention is split by heads)"))
    elif kv % tp and tp % kv:
        problems.append(("tp", tp, f"must divide the model's n_kv_head={kv} or be a multiple of it (KV heads are "
                                   f"split, or replicated when there are fewer than ranks); use a tp that does"))
    elif cfg.d_hidden % tp:
        problems.append(("tp", tp, f"must divide the MLP hidden size {cfg.d_hidden} (d_model x mlp_ratio)"))
    return problems


def kv_heads_per_rank(cfg: GPTConfig, tp: int) -> int:
    """How many KV heads each rank holds: its share when `tp` divides them, else one (replicated)."""
    return max(1, cfg.n_kv // tp)


def kv_layout(cfg: GPTConfig, tp: int) -> str:
    """One line for the log: how attention heads lie on the ranks."""
    q, kv = cfg.n_head // tp, kv_heads_per_rank(cfg, tp)
    how = ("split" if tp <= cfg.n_kv else f"replicated on {tp // cfg.n_kv} ranks each, fewer KV heads than ranks")
    return f"attention over tp={tp}: {q} query and {kv} KV head(s) per rank, KV heads {how}"


def vocab_rows(cfg: GPTConfig, tp_rank: int, tp: int) -> tuple[int, int]:
    """The rows of the vocabulary-parallel head `tp_rank` holds (the vocabulary padded to tp equal parts)."""
    local = -(-cfg.vocab_size // tp)
    return min(tp_rank * local, cfg.vocab_size), min((tp_rank + 1) * local, cfg.vocab_size)


def shard_plan(key: str, cfg: GPTConfig, tp_rank: int, tp: int) -> tuple[int, Ranges] | None:
    """(dimension, index ranges to concatenate) of `key` held by `tp_rank`; None when replicated."""
    if tp == 1:
        return None
    hd, h = cfg.d_head, cfg.d_hidden
    q, kv = cfg.n_head * hd, cfg.n_kv * hd
    ql, hl = q // tp, h // tp
    kl = kv_heads_per_rank(cfg, tp) * hd
    k0 = (tp_rank * kl) if tp <= cfg.n_kv else (tp_rank // (tp // cfg.n_kv)) * hd  # this rank's first KV row
    r = tp_rank
    if key.endswith("attn.c_attn.weight") or key.endswith("attn.c_attn.bias"):
        return 0, [(r * ql, (r + 1) * ql), (q + k0, q + k0 + kl), (q + kv + k0, q + kv + k0 + kl)]
    if key.endswith("attn.c_proj.weight"):
        return 1, [(r * ql, (r + 1) * ql)]
    if key.endswith("mlp.c_fc.weight") or key.endswith("mlp.c_fc.bias"):
        parts = 2 if cfg.mlp == "swiglu" else 1
        return 0, [(j * h + r * hl, j * h + (r + 1) * hl) for j in range(parts)]
    if key.endswith("mlp.c_proj.weight"):
        return 1, [(r * hl, (r + 1) * hl)]
    if key == "lm_head.weight":  # an untied head: this rank's vocabulary rows
        return 0, [vocab_rows(cfg, r, tp)]
    return None


def take(source: Any, plan: tuple[int, Ranges] | None) -> np.ndarray:
    """The part of `source` (a numpy array or an h5py dataset) that `plan` names, as a new array."""
    if plan is None:
        return np.ascontiguousarray(source[()] if not isinstance(source, np.ndarray) else source)
    dim, ranges = plan
    parts = [source[a:b] if dim == 0 else source[:, a:b] for a, b in ranges]
    return np.ascontiguousarray(np.concatenate(parts, axis=dim) if len(parts) > 1 else parts[0])


def shard_state(full: dict[str, Any], cfg: GPTConfig, tp_rank: int, tp: int) -> dict[str, Any]:
    """`tp_rank`'s part of a full in-memory state (numpy arrays or torch tensors)."""
    out: dict[str, Any] = {}
    for key, value in full.items():
        plan = shard_plan(key, cfg, tp_rank, tp)
        if plan is None:
            out[key] = value
        elif isinstance(value, np.ndarray):
            out[key] = take(value, plan)
        else:  # a torch tensor: slice without leaving torch
            import torch

            dim, ranges = plan
            out[key] = torch.cat([value.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()
    return out


@dataclass
class ShardRead:
    """One rank's shard read: its tensors (torch, in the stored dtype), the checkpoint tensors it
    verified, and what failed."""

    state: dict[str, Any]
    bytes_read: int
    verified: list[str]
    bad: list[str]


def read_shard(header: CheckpointHeader, tp_rank: int, tp: int, rank: int, world_size: int,
               keys: list[str] | None = None) -> ShardRead:
    """Read `tp_rank`'s shard of every tensor (of `keys` only, when given), each checked by this
    rank before it is used; ``tp=1`` reads whole tensors (a streamed broadcast's bucket).

    A digest covers a whole tensor (a whole FSDP chunk, in a sharded checkpoint), so this rank reads
    each tensor (chunk) it takes a part of whole, checks it (XXH3-128: memory speed), and keeps its
    part: no rank uses bytes that it did not verify itself, and no rank holds more than its shard
    plus one tensor (chunk). The caller agrees on the outcome across ranks (any bad tensor fails
    every rank). `rank` and `world_size` name the reader in errors.
    """
    import h5py

    if header.pieces is not None:
        return _read_shard_of_chunks(header, tp_rank, tp, keys)
    state: dict[str, Any] = {}
    verified: list[str] = []
    bad: list[str] = []
    nbytes = 0
    with h5py.File(header.path, "r") as f:
        group = f[MODEL_GROUP]
        for key in header.shapes if keys is None else keys:
            whole = _whole(group[key])  # as HDF5 holds it: bfloat16 as its bits, which the digest covers
            nbytes += whole.nbytes
            verified.append(key)
            if not checksum.matches(whole, header.digests[key]):
                bad.append(key)
            arr = take(whole, shard_plan(key, header.config, tp_rank, tp))
            del whole
            state[key] = as_tensor(typed(arr, header.dtypes[key]))
    return ShardRead(state=state, bytes_read=nbytes, verified=verified, bad=bad)


Region = list[tuple[int, int]]  # per dimension, [start, stop)


def _whole(dataset: Any) -> np.ndarray:
    """A dataset read whole into a new array on 4 KiB pages (`hostmem`: huge pages cost the read
    about three times as much on a VM)."""
    arr = hostmem.empty(dataset.shape, dataset.dtype)
    if arr.size:
        dataset.read_direct(arr)
    return arr


def _read_shard_of_chunks(header: CheckpointHeader, tp_rank: int, tp: int, keys: list[str] | None) -> ShardRead:
    """`read_shard` of a sharded checkpoint (FSDP's): each tensor's part `tp_rank` holds is taken
    from the chunks it overlaps, each read whole with one ``os.preadv`` and checked against its own
    digest first."""
    from hpcdist.store.sharded.layout import folder_of, read_chunk

    assert header.pieces is not None
    folder = folder_of(header.path)
    state: dict[str, Any] = {}
    verified: list[str] = []
    bad: list[str] = []
    nbytes = 0
    for key in header.shapes if keys is None else keys:
        shape, pieces = header.shapes[key], header.pieces[key]
        plan = shard_plan(key, header.config, tp_rank, tp)
        dim, ranges = plan if plan is not None else (0, [(0, shape[0])])
        out_shape = list(shape)
        out_shape[dim] = sum(b - a for a, b in ranges)
        out = np.empty(out_shape, dtype=np.dtype(pieces[0].chunk.dtype))
        for piece in pieces:
            copies = []  # (where in `out`, where in the chunk) of each part of this chunk the shard takes
            at = 0  # where this range starts in `out` along `dim`
            for a, b in ranges:
                want = [(0, n) for n in shape]
                want[dim] = (a, b)
                part = _overlap(want, piece.offsets, piece.sizes)
                if part is not None:
                    src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(part, piece.offsets, strict=True))
                    dst = [slice(lo, hi) for lo, hi in part]
                    dst[dim] = slice(at + part[dim][0] - a, at + part[dim][1] - a)
                    copies.append((tuple(dst), src))
                at += b - a
            if not copies:
                continue
            whole = read_chunk(folder, piece.chunk, f"tensor {MODEL_GROUP}.{key}")
            nbytes += whole.nbytes
            verified.append(f"{key} {list(piece.offsets)}")
            if not checksum.matches(whole, piece.chunk.digest):
                bad.append(key)
            for into, src in copies:
                out[into] = whole[src]
        state[key] = as_tensor(typed(out, header.dtypes[key]))
    return ShardRead(state=state, bytes_read=nbytes, verified=verified, bad=sorted(set(bad)))


def _overlap(want: Region, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Region | None:
    """The part of region `want` that the chunk at `offsets` of `sizes` holds, in tensor coordinates."""
    part = [(max(lo, o), min(hi, o + n)) for (lo, hi), o, n in zip(want, offsets, sizes, strict=True)]
    return None if any(lo >= hi for lo, hi in part) else part

"""Values taken to be the same on every rank: which rank writes each, after a check that they are.

DCP's rule is that a value that is not a DTensor is replicated (DDP's model and optimizer): its
planner writes it once, by one rank, and never looks at the other ranks' copies, so a tensor that
differs between ranks (a per-rank RNG state, a model not wrapped in DDP) is saved as whichever
rank DCP chose. A sharded save (``hpcdist.store.sharded.checkpoint``) compares a fingerprint of each such
value across the ranks first (an ``all_gather`` of 32 bytes per value on the checkpoint's group):

- the values every rank holds alike are spread over the ranks, largest first, each to the rank
  with the fewest bytes so far (`owners`), and each rank writes (and, in a background save, copies)
  only its own;
- a value that differs between ranks, or that some rank lacks, is written as the lowest rank
  holding it has it (rank 0's when it has one: what an unsharded save of rank 0's state keeps), and
  reported (`Split.differing`), so that nothing is dropped without a word.

The fingerprint covers the value's type, dtype and shape, and its bytes: all of them with
`full`, else all of a tensor up to 64 KiB and 16 windows of 4 KiB spread over a larger one. A value
that really differs per rank differs nearly everywhere, which the windows see at the cost of a few
microseconds per tensor, on any device (a CUDA tensor's windows come to the host in one copy); a
difference in a few bytes of a large tensor only the full comparison sees (``ctx.checkpoints`` runs
it when its log is at DEBUG level: every byte hashed on every rank, about 15 GB/s per core here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcdist.errors import CheckpointError

WINDOWS = 16  # a large tensor's sampled windows
WINDOW_BYTES = 4096
WHOLE_BYTES = WINDOWS * WINDOW_BYTES  # a tensor up to this size is hashed whole

Path_ = tuple[str, ...]


@dataclass
class Split:
    """This rank's part of a state: `state`, less the replicated values other ranks write, and the
    values this rank writes though the ranks' copies differ (`differing`, their paths)."""

    state: dict[str, Any]
    differing: list[Path_] = field(default_factory=list)
    checked: int = 0  # values compared across the ranks


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" or hasattr(value, "device_mesh")


def holds_dtensor(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(holds_dtensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(holds_dtensor(v) for v in value)
    return _is_dtensor(value)


def leaves(state: Mapping[str, Any], replicated: Callable[[str], bool]) -> list[tuple[Path_, Any]]:
    """The replicated values of `state`: every leaf below a mapping (a list is one leaf) that holds
    no DTensor, under the top-level keys `replicated` accepts."""
    out: list[tuple[Path_, Any]] = []

    def walk(value: Any, path: Path_) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, (*path, str(k)))
        elif not holds_dtensor(value):
            out.append((path, value))

    for key, value in state.items():
        if replicated(str(key)):
            walk(value, (str(key),))
    return out


def nbytes(value: Any) -> int:
    if hasattr(value, "nbytes") and hasattr(value, "dtype"):
        return int(value.nbytes)
    if isinstance(value, list | tuple):
        return sum(nbytes(v) for v in value)
    return 0


def owners(leaves: list[tuple[Any, int]], world: int) -> dict[Any, int]:
    """Which rank writes each leaf (key, bytes): the largest first (ties by key), each to the rank
    with the fewest bytes so far. The same on every rank given the same leaves."""
    load = [0] * world
    out: dict[Any, int] = {}
    for key, size in sorted(leaves, key=lambda item: (-item[1], item[0])):
        rank = min(range(world), key=lambda r: load[r])
        load[rank] += size
        out[key] = rank
    return out


def fingerprints(values: list[Any], *, full: bool, where: list[str]) -> list[bytes]:
    """The 16-byte fingerprint of each value (see the module's docstring)."""
    import torch
    import xxhash

    parts: list[Any] = []  # per value: (header, CPU bytes or the index of its device sample)
    device: list[Any] = []
    for value, name in zip(values, where, strict=True):
        parts.append(_parts(value, full, device, name, torch))
    device_bytes: list[Any] = []
    if device:  # every CUDA sample to the host in one copy
        host = torch.cat(device).cpu().numpy()
        bounds = np.cumsum([0] + [int(d.numel()) for d in device])
        device_bytes = [host[bounds[i]:bounds[i + 1]].data for i in range(len(device))]
    out = []
    for items in parts:
        h = xxhash.xxh3_128()
        for item in items:
            h.update(device_bytes[item] if isinstance(item, int) else item)
        out.append(h.digest())
    return out


def _parts(value: Any, full: bool, device: list[Any], where: str, torch: Any) -> list[Any]:
    """What a value's fingerprint hashes: a header, then its bytes (or their index in `device`)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        head = f"tensor|{t.dtype}|{tuple(t.shape)}|".encode()
        if t.layout != torch.strided or t.is_quantized or t.numel() == 0:
            return [head]
        raw = t.reshape(-1).view(torch.uint8)
        n = raw.numel()
        sampled = not full and n > WHOLE_BYTES
        starts = [(n - WINDOW_BYTES) * i // (WINDOWS - 1) for i in range(WINDOWS)] if sampled else []
        if raw.device.type == "cpu":  # the windows hashed in place
            flat = raw.numpy()
            return [head, *(flat[s:s + WINDOW_BYTES].data for s in starts)] if starts else [head, flat.data]
        if starts:
            raw = torch.cat([raw[s:s + WINDOW_BYTES] for s in starts])
        if full:  # a whole device tensor: to the host on its own
            return [head, raw.cpu().numpy().data]
        device.append(raw)
        return [head, len(device) - 1]
    if isinstance(value, list | tuple):
        out: list[Any] = [f"{type(value).__name__}|{len(value)}|".encode()]
        for i, v in enumerate(value):
            out += _parts(v, full, device, f"{where}[{i}]", torch)
        return out
    if isinstance(value, Mapping):
        out = [f"dict|{len(value)}|".encode()]
        for k, v in value.items():
            out += [f"{k!r}|".encode(), *_parts(v, full, device, f"{where}.{k}", torch)]
        return out
    from hpcdist.store.checkpoint import values

    try:
        return [b"value|", values.to_json(value, where)]
    except CheckpointError:  # the write refuses it in its own words; here it is only compared
        return [f"value|{type(value).__name__}|{value!r}".encode()]


def _key(path: Path_) -> int:
    import xxhash

    return int(np.uint64(xxhash.xxh3_64_intdigest("\0".join(path).encode())).view(np.int64))


def split(state: dict[str, Any], process_group: Any = None, *, replicated: Callable[[str], bool] | None = None,
          full: bool = False) -> Split:
    """This rank's part of `state` for a sharded save by every rank of `process_group` (a
    collective: every rank calls it with its own state). Without a process group (or one of one
    rank) the state is all this rank's."""
    import torch
    import torch.distributed as dist

    from hpcdist.store.checkpoint.collective import gather

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) < 2:
        return Split(state)
    world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    mine = leaves(state, replicated or (lambda key: True))
    prints = fingerprints([v for _, v in mine], full=full, where=[".".join(p) for p, _ in mine])
    rows = np.zeros((len(mine), 4), dtype=np.int64)  # path key, fingerprint (2 words), bytes
    for i, ((path, value), fp) in enumerate(zip(mine, prints, strict=True)):
        rows[i, 0] = _key(path)
        rows[i, 1:3] = np.frombuffer(fp, dtype=np.int64)
        rows[i, 3] = nbytes(value)
    what = "comparing the replicated values across the ranks"
    counts = gather(process_group, torch.tensor([len(mine)], dtype=torch.int64), what)
    most = max(int(c.item()) for c in counts)
    padded = torch.zeros((most, 4), dtype=torch.int64)
    padded[:len(mine)] = torch.from_numpy(rows)
    tables = gather(process_group, padded, what)
    seen: dict[int, list[tuple[int, int, int, int]]] = {}  # path key -> (rank, fp words, bytes) of each holder
    for r, (table, count) in enumerate(zip(tables, counts, strict=True)):
        for key, fp0, fp1, size in table[:int(count.item())].tolist():
            seen.setdefault(key, []).append((r, fp0, fp1, size))
    alike = {k: v[0][3] for k, v in seen.items() if len(v) == world and len({(a, b) for _, a, b, _ in v}) == 1}
    owner = owners(list(alike.items()), world)
    for key, holders in seen.items():
        if key not in alike:
            owner[key] = min(r for r, *_ in holders)
    by_path = {path: owner[_key(path)] for path, _ in mine}
    differing = [p for p in by_path if by_path[p] == rank and _key(p) not in alike]
    return Split(keep(state, lambda path: by_path.get(path, rank) == rank), differing, len(mine))


def report(paths: list[Path_], rank: int) -> str:
    """One line naming the values rank `rank` wrote as it holds them, though the ranks' copies differ."""
    names = ", ".join(".".join(p) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return (f"{len(paths)} value(s) are not the same on every rank and were saved as rank {rank} holds them: "
            f"{names}; pass each rank's own values as per_rank=..., or save(..., replicated=False) to save "
            "rank 0's state whole")


def keep(value: Mapping[str, Any], mine: Callable[[Path_], bool], path: Path_ = ()) -> dict[str, Any]:
    """`value` with only the leaves `mine` accepts (mappings kept, emptied where none is left)."""
    out: dict[str, Any] = {}
    for k, v in value.items():
        sub = (*path, str(k))
        if isinstance(v, Mapping):
            out[k] = keep(v, mine, sub)
        elif mine(sub):
            out[k] = v
    return out

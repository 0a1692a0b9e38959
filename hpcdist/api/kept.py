"""The last checkpoint a rank saved, kept in its memory in a job with spare nodes: after an in-place
restart the ranks that went on in their processes hold it, and send it to the rank started again
instead of every rank reading the storage.

A DDP job's state is the same on every rank (what ``CheckpointManager.save`` takes to be
replicated; train_gpt's tree, built on every rank), so each rank keeps a host copy of what it saved
(``keep``), held across the job's runs in the same process (``hpcdist.runtime.in_job_link``). On a
load, the ranks say which step they hold (`held`); rank 0 takes it when it is the step the
``latest`` pointer names (``hpcdist.api.resume_step``: no step file is read), and the ranks then
share it (``share``): when all hold it, each uses its own copy; when some do, the lowest such rank
sends its copy to the others over the checkpoint I/O group (the structure as plain data, every
array as bytes: nothing is unpickled). A copy of any other step (a save that failed to commit) is
never used; with none, the storage is read as always. The cost is bounded: one host copy of the state
per node (its local rank 0 keeps it; the copy of the step before is dropped first, and a GPU's
tensors are copied to pinned memory behind the step's own work on its stream, not waited for), none
where the copy would take more than half of what the node has free (said once in the log), only in
a job with spares that restarts ranks in place (``on_rank_failure: in_place``, ``KEEP_STATE_VAR``),
and only for a replicated state without per-rank values or DTensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from hpcdist.api.codec import decode, encode
from hpcdist.config.contract import KEEP_STATE_VAR

_KEPT: dict[str, tuple[int, Any, dict[str, Any]]] = {}  # checkpoint directory -> (step, host copy, its facts)
_SKIPPED: set[str] = set()  # the directories whose state was too large to keep (said once)
FREE_SHARE = 0.5  # the most of the node's available memory one copy may take
_TENSOR = "__kept_tensor__"  # a tensor's place in the structure that travels as plain data
_ARRAY = "__kept_array__"  # a NumPy array's
_TEXT = "__kept_text__"  # a NumPy array of strings or bytes: its values travel as plain data


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank keeps its saved state: in a job with spares whose ranks start again in
    place (``on_rank_failure: in_place``, which its supervisor passes on)."""
    return (os.environ if env is None else env).get(KEEP_STATE_VAR) == "1"


def held(directory: str) -> int | None:
    """The step this rank holds in memory for `directory`, or None."""
    kept = _KEPT.get(directory)
    return kept[0] if kept is not None else None


def keep(directory: str, step: int, state: Mapping[str, Any], local_rank: int, log: logging.Logger, *,
         attrs: Mapping[str, Any] | None = None, tree: bool = False) -> None:
    """In a job with spares, on a node's local rank 0, a host copy of `state`, saved as `step` in
    `directory` (the tensors copied now, a GPU's behind the work already queued on its stream:
    training goes on); nothing elsewhere, and nothing where it would not fit. `attrs`: the commit's
    root attributes (plain values) that a load restores; `tree`: `state` is a store tree, given
    back as it is (else a state ``encode`` spells, given back decoded)."""
    if not wanted() or local_rank != 0:
        return
    import numpy as np
    import torch

    _KEPT.pop(directory, None)  # never two copies at once
    encoded = dict(state) if tree else encode(dict(state))
    from hpcdist.store.hostmem import available_bytes

    size, free = _nbytes(encoded), available_bytes()
    if free is not None and size > FREE_SHARE * free:
        if directory not in _SKIPPED:
            _SKIPPED.add(directory)
            log.warning("checkpoint state of %.1f GB not kept in memory for an in-place restart: the node has %.1f GB "
                        "free; a rank started again reads it from the storage", size / 1e9, free / 1e9)
        return

    def host(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: host(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                return pinned.copy_(value.detach(), non_blocking=True)
            return value.detach().to("cpu", copy=True)
        if isinstance(value, np.ndarray):
            return value.copy()
        return value

    _KEPT[directory] = (step, host(encoded), {"attrs": dict(attrs or {}), "tree": tree})


def _nbytes(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    return int(getattr(tree, "nbytes", 0) or 0)


class Kept(NamedTuple):
    """A state from the ranks' memory: as saved, and the root attributes of its commit."""

    state: dict[str, Any]
    attrs: dict[str, Any]


def share(directory: str, step: int, rank: int, local_rank: int, group: Any, log: logging.Logger) -> Kept | None:
    """In a job with spares, the state saved as `step` in `directory`, from this rank's copy or a
    peer's (every rank of `group` calls this alike); None when no rank holds it (or outside such a
    job, or with no group), and the caller reads the storage."""
    if not wanted() or group is None:
        return None
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a kept copy of GPU tensors is complete

    from hpcdist.runtime.plain import all_gather_plain, broadcast_plain

    kept = _KEPT.get(directory)
    mine, facts = (kept[1], kept[2]) if kept is not None and kept[0] == step else (None, {})
    holders = [r for r, has in enumerate(all_gather_plain(mine is not None, group=group, what="kept state"))
               if has]
    if not holders:
        return None
    src = holders[0]
    if len(holders) < dist.get_world_size(group):
        buffers: list[Any] = []
        sent = broadcast_plain({"tree": _skeleton(mine, buffers), "facts": facts} if rank == src else None, src=src,
                               group=group, what="the kept state's structure")
        if rank != src:
            buffers = [torch.empty(n, dtype=torch.uint8) for n in _sizes(sent["tree"])]
        for buffer in buffers:
            dist.broadcast(buffer, src=src, group=group)
        if rank != src:
            mine, facts = _filled(sent["tree"], iter(buffers)), sent["facts"]
            if local_rank == 0:  # the node's copy, for the next restart
                _KEPT[directory] = (step, mine, facts)
    log.info("checkpoint step %d: the state from the ranks' memory (rank %d's), not the storage", step, src)
    state = _cloned(mine)
    return Kept(state if facts.get("tree") else decode(state), dict(facts.get("attrs", {})))


def _bytes_of(value: Any) -> Any:
    """A tensor's or a numeric array's bytes as a flat uint8 tensor (every dtype travels alike)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().contiguous().reshape(-1).view(torch.uint8)
    import numpy as np

    return torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8))


def _skeleton(tree: Any, buffers: list[Any]) -> Any:
    """`tree` with each tensor and array replaced by its kind, dtype and shape (its bytes appended
    to `buffers`); an array of strings or bytes travels in the structure itself."""
    if isinstance(tree, dict):
        return {k: _skeleton(v, buffers) for k, v in tree.items()}
    if hasattr(tree, "dtype") and hasattr(tree, "shape") and not isinstance(tree, (int, float)):
        import numpy as np

        if isinstance(tree, np.ndarray) and tree.dtype.kind in "SUO":
            values = [v.decode("latin-1") if isinstance(v, bytes) else str(v) for v in tree.reshape(-1).tolist()]
            return {_TEXT: [tree.dtype.str, list(tree.shape), values]}
        buffers.append(_bytes_of(tree))
        kind = _ARRAY if isinstance(tree, np.ndarray) else _TENSOR
        dtype = tree.dtype.str if kind == _ARRAY else str(tree.dtype).removeprefix("torch.")
        return {kind: [dtype, list(tree.shape), int(buffers[-1].numel())]}
    return tree


def _sizes(skeleton: Any) -> list[int]:
    """The byte count of each buffer `_skeleton` sent, in order."""
    if isinstance(skeleton, dict):
        if set(skeleton) in ({_TENSOR}, {_ARRAY}):
            [(kind, (dtype, _, nbytes))] = skeleton.items()
            _dtype(kind, str(dtype))  # a dtype that is not one is refused before anything is made
            return [int(nbytes)]
        if set(skeleton) == {_TEXT}:
            return []
        return [n for value in skeleton.values() for n in _sizes(value)]
    return []


def _dtype(kind: str, name: str) -> Any:
    if kind == _TENSOR:
        import torch

        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"kept state: {name!r} is not a torch dtype")
        return dtype
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError as exc:
        raise ValueError(f"kept state: {name!r} is not a NumPy dtype") from exc


def _filled(skeleton: Any, buffers: Iterator[Any]) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            dtype, shape, _ = skeleton[_TENSOR]
            return next(buffers).view(_dtype(_TENSOR, dtype)).reshape([int(n) for n in shape])
        if set(skeleton) == {_ARRAY}:
            dtype, shape, _ = skeleton[_ARRAY]
            return next(buffers).numpy().view(_dtype(_ARRAY, dtype)).reshape([int(n) for n in shape])
        if set(skeleton) == {_TEXT}:
            import numpy as np

            dtype, shape, values = skeleton[_TEXT]
            kind = _dtype(_ARRAY, dtype)
            items = [v.encode("latin-1") for v in values] if kind.kind == "S" else values
            return np.array(items, dtype=kind).reshape([int(n) for n in shape])
        return {k: _filled(v, buffers) for k, v in skeleton.items()}
    return skeleton


def _cloned(tree: Any) -> Any:
    """The caller's own tensors and arrays: one that writes into them leaves the kept copy as saved."""
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if hasattr(tree, "clone"):
        return tree.clone()
    return tree.copy() if hasattr(tree, "copy") and hasattr(tree, "dtype") else tree

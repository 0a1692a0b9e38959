"""The last checkpoint a rank saved, kept in its memory in a job with spare nodes: after an in-place
restart the ranks that went on in their processes hold it, and send it to the rank started again
instead of every rank reading the storage.

A DDP job's state is the same on every rank (what ``Checkpoints.save`` takes to be replicated), so
each rank keeps a host copy of what it saved (``keep``), held across the job's runs in the same
process (``hpcdist.runtime.in_job_link``). On ``load_latest()``, once rank 0 chose the step from the
storage (the newest committed that verifies), the ranks say whether they hold that step
(``share``): when all do, each uses its own copy; when some do, the lowest such rank sends its
copy to the others over the checkpoint I/O group (the structure as plain data, the tensors as
tensors: nothing is unpickled); when none does, the storage is read as always. A copy of any other
step (a save that failed to commit) is never used. The cost is bounded: one host copy of the state
per node (its local rank 0 keeps it; the copy of the step before is dropped first, and a GPU's
tensors are copied to pinned memory behind the step's own work on its stream, not waited for), none
where the copy would take more than half of what the node has free (said once in the log), only in
a job with spares that restarts ranks in place (``on_rank_failure: in_place``, ``KEEP_STATE_VAR``),
and only for a replicated state without per-rank values or DTensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hpcdist.api.codec import decode, encode
from hpcdist.config.contract import KEEP_STATE_VAR

_KEPT: dict[str, tuple[int, Any]] = {}  # checkpoint directory -> (step, encoded state on the host)
_SKIPPED: set[str] = set()  # the directories whose state was too large to keep (said once)
FREE_SHARE = 0.5  # the most of the node's available memory one copy may take
_TENSOR = "__kept_tensor__"  # a tensor's place in the structure that travels as plain data


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank keeps its saved state: in a job with spares whose ranks start again in
    place (``on_rank_failure: in_place``, which its supervisor passes on)."""
    return (os.environ if env is None else env).get(KEEP_STATE_VAR) == "1"


def keep(directory: str, step: int, state: Mapping[str, Any], local_rank: int, log: logging.Logger) -> None:
    """In a job with spares, on a node's local rank 0, a host copy of `state`, saved as `step` in
    `directory` (the tensors copied now, a GPU's behind the work already queued on its stream:
    training goes on); nothing elsewhere, and nothing where it would not fit."""
    if not wanted() or local_rank != 0:
        return
    import torch

    _KEPT.pop(directory, None)  # never two copies at once
    encoded = encode(dict(state))
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
        if hasattr(value, "dtype") and hasattr(value, "shape"):  # a numpy array: a tensor, as a load gives it
            return torch.tensor(value)
        return value

    _KEPT[directory] = (step, host(encoded))


def _nbytes(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    return int(getattr(tree, "nbytes", 0) or 0)


def share(directory: str, step: int, rank: int, local_rank: int, group: Any,
          log: logging.Logger) -> dict[str, Any] | None:
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

    held = _KEPT.get(directory)
    mine = held[1] if held is not None and held[0] == step else None
    holders = [r for r, has in enumerate(all_gather_plain(mine is not None, group=group, what="kept state"))
               if has]
    if not holders:
        return None
    src = holders[0]
    if len(holders) < dist.get_world_size(group):
        tensors: list[Any] = []
        skeleton = broadcast_plain(_skeleton(mine, tensors) if rank == src else None, src=src, group=group,
                                   what="the kept state's structure")
        if rank != src:
            tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in _specs(skeleton)]
        for tensor in tensors:
            dist.broadcast(tensor, src=src, group=group)
        if rank != src:
            mine = _filled(skeleton, iter(tensors))
            if local_rank == 0:  # the node's copy, for the next restart
                _KEPT[directory] = (step, mine)
    log.info("checkpoint step %d: the state from the ranks' memory (rank %d's), not the storage", step, src)
    return decode(_cloned(mine))


def _skeleton(tree: Any, tensors: list[Any]) -> Any:
    """`tree` with each tensor replaced by its dtype and shape (appended to `tensors`)."""
    if isinstance(tree, dict):
        return {k: _skeleton(v, tensors) for k, v in tree.items()}
    if hasattr(tree, "dtype") and hasattr(tree, "shape") and not isinstance(tree, (int, float)):
        tensors.append(tree)
        return {_TENSOR: [str(tree.dtype).removeprefix("torch."), list(tree.shape)]}
    return tree


def _specs(skeleton: Any) -> list[tuple[str, list[int]]]:
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            dtype, shape = skeleton[_TENSOR]
            import torch

            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"kept state: {dtype!r} is not a torch dtype")
            return [(str(dtype), [int(n) for n in shape])]
        return [spec for value in skeleton.values() for spec in _specs(value)]
    return []


def _filled(skeleton: Any, tensors: Any) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return next(tensors)
        return {k: _filled(v, tensors) for k, v in skeleton.items()}
    return skeleton


def _cloned(tree: Any) -> Any:
    """The caller's own tensors: one that writes into them leaves the kept copy as saved."""
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    return tree.clone() if hasattr(tree, "clone") else tree

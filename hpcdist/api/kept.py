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
step (a save that failed to commit) is never used. The cost is one host copy of the state per
rank, only in a job with spares that restarts ranks in place (``KEEP_STATE_VAR``), and only for a
replicated state without per-rank values or DTensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hpcdist.api.codec import decode, encode
from hpcdist.config.contract import KEEP_STATE_VAR

_KEPT: dict[str, tuple[int, Any]] = {}  # checkpoint directory -> (step, encoded state on the host)
_TENSOR = "__kept_tensor__"  # a tensor's place in the structure that travels as plain data


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether this rank keeps its saved state: in a job with spares whose ranks start again in
    place (``on_rank_failure: in_place``, which its supervisor passes on)."""
    return (os.environ if env is None else env).get(KEEP_STATE_VAR) == "1"


def keep(directory: str, step: int, state: Mapping[str, Any]) -> None:
    """In a job with spares, a host copy of `state`, saved as `step` in `directory` (the tensors
    copied now: training goes on); nothing elsewhere."""
    if not wanted():
        return
    import torch

    def host(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: host(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        if hasattr(value, "dtype") and hasattr(value, "shape"):  # a numpy array: a tensor, as a load gives it
            return torch.tensor(value)
        return value

    _KEPT[directory] = (step, host(encode(dict(state))))


def share(directory: str, step: int, rank: int, group: Any, log: logging.Logger) -> dict[str, Any] | None:
    """In a job with spares, the state saved as `step` in `directory`, from this rank's copy or a
    peer's (every rank of `group` calls this alike); None when no rank holds it (or outside such a
    job, or with no group), and the caller reads the storage."""
    if not wanted() or group is None:
        return None
    import torch
    import torch.distributed as dist

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

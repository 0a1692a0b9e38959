"""``load_latest(into=state)``: a sharded checkpoint filled into a state of any layout, in place.

DTensors of another mesh or world size, or plain tensors in one process: each rank reads and
verifies only the chunks it needs (``hpcdist.store.sharded.checkpoint``). The step is the newest
committed one that verifies (``hpcdist.api.resume_step``'s rule): a step whose chunks fail their
checksums is reported and the next older one tried, on every rank alike. Each rank's own values
(`per_rank` of ``CheckpointManager.save``) come back to the same rank. Only this user's own steps
are read (``hpcdist.store.checkpoint.owned``): another user's is skipped with one warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hpcdist.errors import CheckpointError

# hpcdist.api.checkpoints.CheckpointManager, which imports this module: typed by name only, no import circle
Manager = Any

PER_RANK = "__per_rank__"  # a sharded checkpoint's values of each rank: ``__per_rank__.r<rank:05d>.<key>``
PER_RANK_ATTR = "per_rank_json"  # root attribute: the per-rank keys (`save`'s `per_rank`) and the world size


def rank_key(rank: int) -> str:
    return f"r{rank:05d}"


def per_rank_keys(attrs: Mapping[str, Any], rank: int) -> list[str] | None:
    """The per-rank keys a checkpoint holds for `rank` ([] when it has none; None when it has them
    for fewer ranks, saved at a smaller world size)."""
    record = json.loads(str(attrs.get(PER_RANK_ATTR, "{}")) or "{}")
    if not record:
        return []
    return [str(k) for k in record["keys"]] if rank < int(record["world_size"]) else None


def load_into(manager: Manager, into: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(step, `into`) filled from the newest committed sharded checkpoint whose chunks verify, or None."""
    from hpcdist.store.sharded import checkpoint as sharded

    ctx = manager.ctx
    manager.wait()  # a background save in flight uses the I/O group too
    # committed steps, newest first: whether each is sharded, and its per-rank record
    steps: list[tuple[int, bool, str]] = []
    error = ""
    if ctx.is_main:
        try:
            steps = own_steps(manager)
        except (CheckpointError, OSError) as exc:
            error = str(exc)
    steps, error = manager.share((steps, error), "its list of committed checkpoints")
    if error:
        raise CheckpointError(error)
    mine_key = rank_key(ctx.rank)
    for step, is_sharded, per_rank in steps:
        if not is_sharded:  # never skip a newer unsharded step for an older sharded one
            raise CheckpointError(
                f"checkpoint {manager.store.path(step)} was saved unsharded: load it with load_latest() "
                "without into= and load_state_dict, or save sharded (save(..., sharded=True))")
        keys = per_rank_keys({PER_RANK_ATTR: per_rank}, ctx.rank)
        if keys is None:
            ctx.log.warning("checkpoint step %d holds no per-rank values of rank %d (saved at another "
                            "world size): they keep their values", step, ctx.rank)
        mine = {k: into[k] for k in keys or () if k in into}
        view = {k: v for k, v in into.items() if k not in mine}
        if mine:
            view[PER_RANK] = {mine_key: mine}
        try:
            attrs = sharded.load(manager.store.path(step), view, process_group=manager.io_group, own=True)
        except CheckpointError as exc:
            ctx.log.warning("checkpoint step %d not loaded: %s", step, exc)
            continue
        into.update({k: v for k, v in view.items() if k != PER_RANK})  # values DCP put in place of the old
        into.update(view.get(PER_RANK, {}).get(mine_key, {}))
        manager.restore_counts(attrs)
        return step, into
    return None


def own_steps(manager: Manager) -> list[tuple[int, bool, str]]:
    """Rank 0: the committed steps that are this user's own, newest first: whether each is
    sharded, and its per-rank record; another user's is skipped with one warning (``owned``)."""
    from hpcdist.store.checkpoint import owned
    from hpcdist.store.checkpoint.single import read_header
    from hpcdist.store.sharded import checkpoint as sharded

    store = manager.store
    steps: list[tuple[int, bool, str]] = []
    with store.opened() as here:
        for step in reversed(store.steps()):
            path = store.path(step)
            why = owned.step_problem(here / path.name)
            if why is not None:
                manager.ctx.log.warning("skipping checkpoint %s: %s", path, why)
                continue
            try:
                attrs = read_header(here / path.name, "sharded").attrs
                steps.append((step, sharded.is_sharded(attrs), str(attrs.get(PER_RANK_ATTR, ""))))
            except CheckpointError:
                steps.append((step, True, ""))  # unreadable: the load below reports it and goes on
    return steps

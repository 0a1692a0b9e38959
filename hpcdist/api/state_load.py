"""``CheckpointManager.load(step=-1)``: the scheduled ``CheckpointState`` restored from the chosen step.

The step is ``hpcdist.api.resume_step``'s (the newest committed one that verifies, or the one the
ranks hold in memory after an in-place restart), once the state's ``check`` accepted rank 0's read
of it: the state is asked here, with what the choice gave, not from inside the choice. From memory
no step file is read: the state comes from this rank's copy or a peer's (``hpcdist.api.kept``).
From storage every rank reads the file (checksums verified; rank 0 reuses the read it verified
while choosing), and a sharded state first fills its shards from the chosen step or, when its
chunks fail their checksums, the next older one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hpcdist.api import kept, resume_step
from hpcdist.api.state import Source
from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint.directory import step_of

# hpcdist.api.checkpoints.CheckpointManager, which imports this module: typed by name only, no import circle
Manager = Any

if TYPE_CHECKING:
    from hpcdist.api.state import CheckpointState


def load(manager: Manager, state: CheckpointState, step: int = -1) -> bool:
    """`state` restored from `step` (-1: the newest); False when there is no checkpoint to restore."""
    manager.wait()  # a background save in flight uses the I/O group too
    choice, held = resume_step.propose(manager, step, unusable=state.unusable, clean=True, mapped=True,
                                       older=state.sharded)
    latest = choice.checkpoint  # rank 0's verified read of the chosen file (None elsewhere, or from memory)
    if latest is not None:  # the state's own test of it, before any rank reads a tensor
        try:
            choice.refuse(state.check(latest, latest.path))
        except Exception as exc:  # an error every rank raises (`agree`): no rank waits for rank 0
            choice.refuse(str(exc) if isinstance(exc, CheckpointError) else
                          f"choosing a checkpoint in {manager.directory} failed: {type(exc).__name__}: {exc}")
    shared = resume_step.agree(manager, choice)
    chosen = shared["step"]
    if chosen is None:
        return False
    if chosen in held and not state.sharded:
        t0 = time.perf_counter()
        copy = kept.share(str(manager.directory), chosen, manager.ctx.rank, manager.ctx.local_rank, manager.io_group,
                          manager.ctx.log)
        if copy is not None:
            size = _nbytes(copy.state)
            state.load_state_dict(copy.state, Source(chosen, manager.store.path(chosen), True, size,
                                                     time.perf_counter() - t0))
            return True
    path = manager.store.path(chosen)
    if state.sharded:  # each shard read through the checked folder (``sharded.load(own=True)``)
        path = state.load_sharded(manager, [path, *(manager.store.path(s) for s in shared["older"])])
    # each rank reads it through its checkpoint folder, checked and held open: yours, whatever is renamed
    ours = latest if latest is not None and latest.step == step_of(path) else None
    t0 = time.perf_counter()
    loaded = ours or manager.store.load(step_of(path) or 0)  # a sharded checkpoint's index: all but shards
    seconds = loaded.seconds if ours is None else loaded.seconds or time.perf_counter() - t0
    state.load_state_dict(loaded.tree, Source(loaded.step, path, False, loaded.bytes, seconds))
    return True


def _nbytes(tree: object) -> int:
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    return int(getattr(tree, "nbytes", 0) or 0)

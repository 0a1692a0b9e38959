"""``CheckpointState``: what a scheduled checkpoint holds, and how it comes back.

torchtitan registers its ``Stateful``s (model, optimizer, data loader, train state) with its
``CheckpointManager``; here one object plays that part for ``CheckpointManager.schedule``:
``state_dict`` gives the store tree (written at the file's root), ``load_state_dict`` restores
one, as a load chose it (`Source`: from storage or from the ranks' memory). A state sharded over
the ranks (FSDP2) gives its DTensors too (``sharded_state_dict``), and fills them in place from the
first checkpoint whose shards verify (``load_sharded``). The hooks (``check``, ``saved``,
``stopping``, ``named``) let the caller test a chosen file, record a commit, say why it stops and
name a collective that failed. train_gpt's is ``hpcdist.train.checkpoint.TrainState``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# hpcdist.api.checkpoints.CheckpointManager, which imports this module: typed by name only, no import circle
Manager = Any

if TYPE_CHECKING:
    from hpcdist.store.checkpoint.single import Checkpoint


@dataclass(frozen=True)
class Source:
    """Where a load's state came from: the checkpoint `path`, from the ranks' `memory` or read
    from storage (`bytes` in `seconds`)."""

    step: int
    path: Path
    memory: bool
    bytes: int = 0
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


class CheckpointState:
    """The state a ``CheckpointManager`` saves when its policy says, and restores on ``load``."""

    sharded = False  # the model and optimizer are DTensors each rank saves its part of
    unusable = ""  # "error": files there but none usable is an error, not a fresh start (else a warning)

    def state_dict(self) -> dict[str, Any]:
        """The store tree to save (rank 0's is written; every rank's when kept in memory)."""
        raise NotImplementedError

    def load_state_dict(self, tree: dict[str, Any], source: Source) -> None:
        """Restore `tree`, the state saved at ``source.step``."""
        raise NotImplementedError

    def sharded_state_dict(self) -> dict[str, Any]:
        """The DTensors every rank writes its part of (with `sharded`)."""
        return {}

    def load_sharded(self, manager: Manager, paths: list[Path]) -> Path:
        """Fill the sharded state from the first of `paths` (newest first) whose shards verify; which."""
        raise NotImplementedError

    def attrs(self) -> dict[str, Any]:
        """Root attributes of the next checkpoint."""
        return {}

    def epoch(self) -> int:
        return 0

    def check(self, checkpoint: Checkpoint, path: Path) -> str | None:
        """Rank 0: why the chosen checkpoint (its verified read, of the file `path`) cannot be
        restored into this state, or None; asked before any rank reads it."""
        return None

    def saved(self, path: Path | None, background: bool) -> None:
        """After every rank returned from a save of `path` (still in flight with `background`)."""

    def stopping(self, step: int) -> None:
        """The policy stops the loop at `step` on a signal: say so."""

    def named(self, what: str) -> AbstractContextManager[Any]:
        """Around a collective of the manager's: a failure inside names `what`."""
        return nullcontext()

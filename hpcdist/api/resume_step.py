"""Which step a resume takes: the newest committed step that verifies, one rule for every caller.

``CheckpointManager.load`` (train_gpt's resume) and ``load_latest`` (the user's code) both ask
`choose`, on rank 0 (`propose`), in the checkpoint folder held open (only a folder of this user's,
each file read through it: ``hpcdist.store.checkpoint.owned``):

- when the ranks hold the step the ``latest`` pointer names in memory (an in-place restart in a
  job with spares, ``hpcdist.api.kept``), that step, and no step file is read: the copy is what
  was written and hashed at that commit;
- else the newest committed step whose checksums verify (``discovery.scan``: what is skipped is
  said, one line each), read once here (`Choice.checkpoint`) so that the load does not read it
  again;
- else nothing: a fresh start, or with `unusable="error"` an error when files were there but none
  could be used.

The caller may then test rank 0's read of the chosen file (``load``: the state's ``check``,
train_gpt's model shapes, tokenizer, sharding), whose refusal (`Choice.refuse`) is an error, not
a reason to take an older step. Every rank is then told (`agree`), and the store writes for the
chosen checkpoint's run (``CheckpointStore.continue_run``). The format (reading, verifying) is the
store's; only the choice is made here, and nothing here calls back into the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint.directory import POINTER, read_commit, step_of
from hpcdist.store.checkpoint.owned import pointer_problem, shown
from hpcdist.store.checkpoint.single import RUN_ATTR
from hpcdist.store.checkpoint.tree import plain

# hpcdist.api.checkpoints.CheckpointManager, which imports this module: typed by name only, no import circle
Manager = Any

if TYPE_CHECKING:
    from hpcdist.store.checkpoint.manager import CheckpointStore
    from hpcdist.store.checkpoint.single import Checkpoint


@dataclass
class Choice:
    """Rank 0's choice: the step (None: start fresh), whether the ranks' memory holds it, the
    committed steps older than it, newest first (a sharded load's fallbacks), an error every rank
    raises, the verified read of the chosen file and the run it belongs to (rank 0's, not shared)."""

    step: int | None
    memory: bool = False
    older: list[int] = field(default_factory=list)
    error: str = ""
    checkpoint: Checkpoint | None = None
    run_id: str | None = None

    def shared(self) -> dict[str, object]:
        """What the other ranks are told (plain data)."""
        return {"step": self.step, "memory": self.memory, "older": self.older, "error": self.error}

    def refuse(self, why: str | None) -> None:
        """The caller's own test of the chosen file (train_gpt's model shapes, tokenizer, sharding)
        says why it cannot be restored: an error on every rank, not a reason to take an older step."""
        if why:
            self.step, self.memory, self.older, self.error, self.checkpoint = None, False, [], why, None


def propose(manager: Manager, step: int = -1, **how: Any) -> tuple[Choice, set[int]]:
    """The ranks say which step they hold in memory (in a job with spares); rank 0 chooses
    (`choose`, `how` its options; elsewhere an empty `Choice`). Nothing is shared yet: the caller
    may test rank 0's read of the chosen file (``Choice.refuse``) before `agree`."""
    from hpcdist.api import kept

    held: set[int] = set()
    if kept.wanted():
        mine = kept.held(str(manager.directory))
        if manager.io_group is not None:
            from hpcdist.runtime.plain import all_gather_plain

            held = {s for s in all_gather_plain(mine, group=manager.io_group, what="the step it holds in memory")
                    if s is not None}
        elif mine is not None:
            held = {mine}
    choice = Choice(None)
    if manager.ctx.is_main:
        try:
            choice = choose(manager.store, held, manager.ctx.log.warning, step=step, **how)
        except CheckpointError as exc:  # a folder another user could have written, named: one line
            choice.error = str(exc)
        except Exception as exc:
            choice.error = f"choosing a checkpoint in {manager.directory} failed: {type(exc).__name__}: {exc}"
    return choice, held


def agree(manager: Manager, choice: Choice) -> dict[str, Any]:
    """Every rank is told rank 0's `choice`, or raises its error; the store then writes for the
    chosen checkpoint's run (``CheckpointStore.continue_run``)."""
    if manager.ctx.is_main and choice.run_id is not None and choice.step is not None:
        manager.store.continue_run(choice.run_id)  # its run: this run's commits and pruning go on with its files
    shared: dict[str, Any] = manager.share(choice.shared(), "its choice of checkpoint")
    if shared["error"]:
        raise CheckpointError(shared["error"])
    return shared


def on_every_rank(manager: Manager, step: int = -1, **how: Any) -> tuple[dict[str, Any], Any, set[int]]:
    """``CheckpointManager.choose``: `propose`, then `agree` on it; (what every rank was told,
    rank 0's verified read of the chosen file, the steps the ranks hold in memory)."""
    choice, held = propose(manager, step, **how)
    return agree(manager, choice), choice.checkpoint, held


def choose(store: CheckpointStore, held: Collection[int], report: Callable[[str], None], *,
           step: int = -1, unusable: str = "", clean: bool = False, mapped: bool = False,
           older: bool = False) -> Choice:
    """Rank 0's `Choice` in `store`'s folder; `held`: the steps the ranks hold in memory; `step`:
    that step only (-1: the newest); `clean`: remove what killed writers left first; `mapped`: the
    read's arrays as views of the file; `older`: the committed steps older than the chosen one too.
    A folder another user could have written is a CheckpointError."""
    with store.opened() as here:
        choice = _choose(store, here, held, report, step, unusable, clean, mapped)
        if older and choice.step is not None and not choice.memory:
            choice.older = [s for s in reversed(store.steps()) if s < choice.step]
    choice.error = shown(choice.error, here, store.directory)  # named as the user names the folder
    return choice


def _choose(store: CheckpointStore, here: Path, held: Collection[int], report: Callable[[str], None], step: int,
            unusable: str, clean: bool, mapped: bool) -> Choice:
    """`choose` in the held folder `here`."""
    commit = read_commit(here) if pointer_problem(here / POINTER) is None else None
    newest = step_of(commit.path) if commit is not None and commit.path is not None else None
    if commit is not None and newest is not None and newest in held and step in (-1, newest):
        return Choice(newest, memory=True, run_id=commit.run or "")
    from hpcdist.store.checkpoint.discovery import Scan, scan

    if step >= 0:
        if clean:
            Scan(None, removed=store.remove_temporaries()).tell(report)
        try:
            loaded = store.load(step, mapped=mapped, within=here)
        except CheckpointError as exc:
            return Choice(None, error=str(exc))
        return Choice(loaded.step, checkpoint=loaded, run_id=str(plain(loaded.attrs.get(RUN_ATTR, ""))))
    found = scan(store.directory, keep=True, mapped=mapped, within=here, clean=clean).tell(report)
    if found.checkpoint is None:
        if unusable == "error" and (found.skipped or (store.directory / POINTER).exists()):
            reasons = "; ".join(found.report())
            return Choice(None, error=f"no usable checkpoint in {store.directory} ({reasons}); fix or remove them, "
                                      f"or set params.checkpoint.if_unusable=start_fresh to start over")
        if unusable and (found.skipped or (store.directory / POINTER).exists()):
            report(f"no usable checkpoint in {store.directory}: starting fresh (params.checkpoint.if_unusable)")
        return Choice(None)
    return Choice(found.checkpoint.step, checkpoint=found.checkpoint, run_id=found.run_id)

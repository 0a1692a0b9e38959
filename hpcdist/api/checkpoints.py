"""``CheckpointManager``: ``ctx.checkpoints``, the one checkpoint manager of train_gpt and of your code.

It owns every decision about a run's checkpoints, as torchtitan's ``CheckpointManager`` does:
when a step saves (``save(step, last_step=...)``, the policy of ``schedule``: ``save_policy``),
what goes in (the scheduled ``CheckpointState``, or the state given to ``save``), where it goes
(one file, sharded, in the background, kept in memory for an in-place restart: ``kept``), and
which step a load takes (``load(step=-1)``, ``load_latest``: the newest committed step that
verifies, ``resume_step``, one rule). The format is ``hpcdist.store``'s, with no policy.

Rank 0 claims the directory (one writer per directory) and writes; every rank returns once a save
is committed (or raises the same error); every rank loads the one step rank 0 chose. The other
ranks wait on a group of their own whose timeout is the checkpoint I/O budget (``io_timeout_s``):
a large checkpoint on slow storage is not a hang. At one rank (or ``replicated=False``) ``save``
nests the state, encoded, under ``/state``; ``save_tree`` writes a store tree at the file's root
(the GPT's ``/model`` that ``infer_gpt`` reads). At two ranks or more, and for DTensors, ``save``
is sharded (``hpcdist.store.sharded.checkpoint``): every rank writes its own part, rank 0 commits
the index. ``load_latest()`` gives every rank the whole state, read and verified once per node
(``hpcdist.store.sharded.node_read``); ``load_latest(into=state)`` fills any layout in place
(``sharded_load``). Only checkpoints no one else could have written are read
(``hpcdist.store.checkpoint.owned``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpcdist.api import kept
from hpcdist.api.codec import broadcast_data, decode, encode
from hpcdist.api.save_policy import PREEMPTED, SavePolicy
from hpcdist.api.sharded_load import PER_RANK, PER_RANK_ATTR, load_into, per_rank_keys, rank_key
from hpcdist.errors import CheckpointError
from hpcdist.runtime.requeue import Requeues

if TYPE_CHECKING:
    from hpcdist.api.state import CheckpointState
    from hpcdist.store.checkpoint.claim import Claim
    from hpcdist.store.checkpoint.manager import CheckpointStore
    from hpcdist.store.checkpoint.single import SaveStats
    from hpcdist.store.sharded.node_read import ReadStats


class Owner(Protocol):
    """What the checkpoints use of a rank's context (``hpcdist.api.Context``, which this module does not import)."""

    log: logging.Logger
    io_timeout_s: float | None
    restarts: int

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def job_id(self) -> str: ...
    def broadcast(self, value: Any) -> Any: ...
    def counts_if_requeued(self) -> Requeues: ...
    def restore_requeues(self, counts: Requeues, job_id: str) -> None: ...
    def should_stop(self) -> bool: ...
    def ignore_stop(self) -> None: ...


DEFAULT_IO_TIMEOUT_S = 1800.0  # a checkpoint's write, hash and commit: 1 TB at 0.6 GB/s
COUNT_ATTR = "requeue_count_json"  # root attribute: the job id and its requeue count when saved


class CheckpointManager:
    """The job's checkpoints as every rank uses them: rank 0 claims and writes, all load."""

    def __init__(self, ctx: Owner, directory: Path, keep_last: int | None) -> None:
        from hpcdist.store.checkpoint.manager import CheckpointStore

        self.ctx = ctx
        self.store: CheckpointStore = CheckpointStore(directory, keep_last=keep_last, job_id=ctx.job_id,
                                                      report=ctx.log.warning)
        self.claim: Claim | None = None
        self.committed: list[SaveStats] = []  # rank 0: every save committed so far, oldest first
        self.loaded: list[ReadStats] = []  # every whole sharded state this rank loaded (`load_latest()`)
        self._sharing: Any = None  # the I/O group's ranks by node (``hpcdist.store.sharded.node_read.Sharing``)
        error = ""
        if ctx.is_main:
            try:
                from dataclasses import replace

                from hpcdist.store.checkpoint.claim import Holder

                # the context's restart count: a requeue of this job takes its own claim back
                self.claim = self.store.claim(replace(Holder.this_process(), restarts=ctx.restarts))
                if self.claim.took_over is not None:
                    ctx.log.warning("took over the stale claim of %s on %s", self.claim.took_over.describe(), directory)
            except CheckpointError as exc:
                error = str(exc)
        import torch.distributed as dist

        if dist.is_initialized() and ctx.world_size > 1:  # on the job's group: the I/O group comes below
            error = broadcast_data(error, ctx.is_main, "its claim on the directory")
        if error:
            raise CheckpointError(error)
        self.io_timeout_s = ctx.io_timeout_s or DEFAULT_IO_TIMEOUT_S
        self._io_group: Any = None
        self._sharded_pending: tuple[Any, Any] | None = None  # (ShardedWriter, Future) of a background save
        self._stager: Any = None  # host buffers of background sharded saves, reused
        self._in_flight = False  # every rank: a background save of rank 0's file may be in flight
        self.policy: SavePolicy | None = None  # when a step saves, and what (`schedule`)
        self.state: CheckpointState | None = None
        self.stop = ""  # why the loop stops: "preempted" (a signal), "run_steps", or "" (it does not)
        if dist.is_initialized() and ctx.world_size > 1:  # every rank makes it, here, in the same order
            from datetime import timedelta

            self._io_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.io_timeout_s))

    def share(self, value: Any, what: str = "a checkpoint") -> Any:
        """Rank 0's `value` on every rank, waiting up to the I/O budget (rank 0 may be writing).
        `value` is plain data, sent as data (``broadcast_data``); anything else is one
        CheckpointError, raised on every rank."""
        if self._io_group is None:
            return value
        try:
            return broadcast_data(value, self.ctx.is_main, what, self._io_group)
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise CheckpointError(
                f"rank {self.ctx.rank} waited for rank 0's checkpoint I/O ({what}) in {self.directory}: no answer "
                f"within the budget of {self.io_timeout_s:g} s (checkpoint.io_timeout_s), or rank 0 is gone ({first})"
            ) from exc

    @property
    def directory(self) -> Path:
        return self.store.directory

    def save(self, step: int, state: Mapping[str, Any] | None = None, *, last_step: bool = False,
             attrs: Mapping[str, Any] | None = None, background: bool = False, sharded: bool | None = None,
             index: Mapping[str, Any] | None = None, replicated: bool = True,
             per_rank: Mapping[str, Any] | None = None) -> Path | None:
        """Commit `state` (a nested dict of tensors, arrays and plain values) as `step`; every rank
        returns once it is committed (once it is copied, with `background`), or raises the same
        error. Returns where the checkpoint is (or will be once committed).

        Without `state`, torchtitan's ``save(curr_step, last_step=...)``: the loop asks every step,
        and the policy of `schedule` decides whether this one saves the scheduled state (its path,
        else None) and whether the loop stops (`stop` says why).

        What is not a DTensor is taken to be the same on every rank (DDP's model and optimizer;
        DCP's rule), so at 2 ranks or more the state is saved sharded: each value written once, the
        writing spread over the ranks, rank 0 committing (``hpcdist.store.sharded.checkpoint``). The ranks'
        copies are compared first (``hpcdist.store.sharded.replicas``: a sample of each tensor's bytes, all
        of them when the log is at DEBUG); a value that differs is saved as rank 0 holds it, as an
        unsharded save would, and named in a warning. `replicated=False` (or `sharded=False`) saves
        rank 0's state in one file instead; DTensors (FSDP2, tensor parallelism) are saved sharded
        either way. `per_rank` holds the values that differ between ranks (RNG states, a data
        loader's position): each rank's are written by that rank and come back to the same rank
        (`load_latest`). Rank 0's `index`, a store tree of small values, goes into a sharded
        checkpoint's index file, where ``hpcdist.store.read(path, groups=...)`` reads it alone.
        """
        from hpcdist.store.sharded.replicas import holds_dtensor

        if state is None:
            return self._save_scheduled(step, last_step)
        if sharded is None:
            sharded = holds_dtensor(state) or per_rank is not None or (replicated and self.ctx.world_size > 1)
        if sharded:
            full = dict(state)
            if per_rank:
                clash = sorted(set(per_rank) & set(state))
                if clash:
                    raise ValueError(f"per_rank keys {clash} are in the state too; give each value one key")
                full[PER_RANK] = {rank_key(self.ctx.rank): dict(per_rank)}
                attrs = {**(attrs or {}), PER_RANK_ATTR: json.dumps({"keys": sorted(per_rank),
                                                                     "world_size": self.ctx.world_size})}
            elif replicated and not holds_dtensor(state):
                kept.keep(str(self.directory), step, state, self.ctx.local_rank, self.ctx.log,  # with spares: in memory
                          attrs=self._commit_attrs(attrs))
            return self._save_sharded(step, full, attrs, background, index)
        if index is not None:
            raise ValueError("index= is for sharded saves; put the values into the state")
        return self._commit(step, lambda: {"state": encode(state)}, 0, attrs, background)

    def save_tree(self, step: int, tree: Mapping[str, Any], *, epoch: int = 0, attrs: Mapping[str, Any] | None = None,
                  background: bool = False, replicated: bool = False) -> Path:
        """`save` for a store tree (nested dicts of arrays, tensors and attribute values, not
        encoded) written as it is at the file's root, for a layout another reader knows. Rank 0's
        is written; with `replicated`, every rank gives the same tree, kept in memory for an
        in-place restart in a job with spares."""
        if replicated:
            kept.keep(str(self.directory), step, tree, self.ctx.local_rank, self.ctx.log,
                      attrs=self._commit_attrs(attrs), tree=True)
        return self._commit(step, lambda: tree, epoch, attrs, background)

    def _commit_attrs(self, attrs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The root attributes every commit records (the hook for a commit's run identity)."""
        counts = self.ctx.counts_if_requeued()  # restored by load_latest: the bound survives the requeue
        return {**(attrs or {}), COUNT_ATTR: json.dumps(
            {"job_id": self.ctx.job_id, "requeues": counts.requeues, "timeouts": counts.timeouts})}

    def _save_sharded(self, step: int, state: dict[str, Any], attrs: Mapping[str, Any] | None,
                      background: bool, index: Mapping[str, Any] | None = None) -> Path:
        from hpcdist.store.sharded import checkpoint as sharded
        from hpcdist.store.sharded import replicas
        self.wait()  # the save before this one (either kind), and its error, on every rank
        writer = sharded.ShardedWriter(self.directory, step, attrs=self._commit_attrs(attrs),
                                       keep_last=self.store.keep_last,
                                       identity=self.store.commit_identity if self.ctx.is_main else None,
                                       tree=index if self.ctx.is_main else None)
        state = sharded.prepare(state, writer, self._io_group, replicated=lambda key: key != PER_RANK,
                                full=self.ctx.log.isEnabledFor(logging.DEBUG))  # each rank's own part
        if writer.differing:
            self.ctx.log.warning("checkpoint step %d: %s", step, replicas.report(writer.differing, self.ctx.rank))
        if background:
            if self._stager is None:
                self._stager = sharded.Stager(self._io_group)
            self._sharded_pending = (writer, sharded.save_async(state, writer, self._io_group, self._stager))
        else:
            sharded.save_with(state, writer, self._io_group)
            self._record(writer.stats)
        return self.store.path(step)

    def _commit(self, step: int, make: Callable[[], Mapping[str, Any]], epoch: int,
                attrs: Mapping[str, Any] | None, background: bool) -> Path:
        attrs = self._commit_attrs(attrs)
        self._in_flight = self._in_flight or background
        error = ""
        if self.ctx.is_main:
            try:
                self._record(self.store.wait())  # the save before this one, and its error
                if background:
                    self.store.save_async(step, make(), epoch=epoch, attrs=attrs)
                else:
                    self._record(self.store.save(step, make(), epoch=epoch, attrs=attrs))
            except CheckpointError as exc:
                error = str(exc)
            except Exception as exc:
                error = f"saving step {step} in {self.directory} failed: {type(exc).__name__}: {exc}"
        error = self.share(error, f"step {step}")
        if error:
            raise CheckpointError(error)
        return self.store.path(step)

    def wait(self) -> None:
        """Every rank returns once a background save in flight is committed, or raises its error."""
        pending, self._sharded_pending = self._sharded_pending, None
        if pending is not None:  # every rank holds one; DCP gives all of them the same outcome
            from hpcdist.store.sharded import checkpoint as sharded

            sharded.wait(pending[1])
            self._record(pending[0].stats)
        if not self._in_flight:  # no background save of rank 0's file since the last wait: nothing to share
            return
        self._in_flight = False
        error = ""
        if self.ctx.is_main:
            try:
                self._record(self.store.wait())
            except Exception as exc:
                error = str(exc) if isinstance(exc, CheckpointError) else (
                    f"saving in {self.directory} failed: {type(exc).__name__}: {exc}")
        error = self.share(error, "the checkpoint in flight")
        if error:
            raise CheckpointError(error)

    def _record(self, stats: SaveStats | None) -> None:
        if stats is None:
            return
        self.committed.append(stats)
        self.ctx.log.info(
            "checkpoint %s committed: %.1f MB in %.2f s (%.0f MB/s)%s", stats.path, stats.bytes / 1e6,
            stats.seconds, stats.mb_per_s, f"; removed {len(stats.removed)} older" if stats.removed else "",
        )

    # ---------------------------------------------------------------- the scheduled saves

    def schedule(self, policy: SavePolicy | None, state: CheckpointState) -> None:
        """Save `state` when `policy` says (``save(step, last_step=...)``; None: not yet, a resume
        comes first) and restore it (``load``)."""
        self.policy, self.state, self.stop = policy, state, ""

    def due(self, step: int, *, last_step: bool = False) -> bool:
        """Whether ``save(step, last_step=...)`` may save or stop at `step` (asked before the loop
        flushes what the checkpoint records)."""
        return self.policy is not None and self.policy.due(step, last_step)

    def _save_scheduled(self, step: int, last_step: bool) -> Path | None:
        policy, state = self.policy, self.state
        if policy is None or state is None:
            raise ValueError("save(step) without a state saves what schedule() named; call schedule() first")
        with state.named(f"training step {step} (stop agreement all_reduce)"):
            decision = policy.decide(step, last_step, self.ctx.should_stop)
        if decision.signal_ignored:
            self.ctx.ignore_stop()
        self.stop = decision.stop
        if decision.stop == PREEMPTED:
            state.stopping(step)
        if not decision.saves:
            return None
        background = policy.background and not decision.final
        how = "sharded checkpoint save" if state.sharded else "checkpoint gather to rank 0"
        with state.named(f"training step {step} ({how})"):
            tree = state.state_dict()
            if state.sharded:  # every rank writes its shards; rank 0's small groups go into the index
                path = self.save(step, state.sharded_state_dict(), attrs=state.attrs(), background=background,
                                 sharded=True, index=tree if self.ctx.is_main else None)
            else:
                path = self.save_tree(step, tree, epoch=state.epoch(), attrs=state.attrs(), background=background,
                                      replicated=kept.wanted())
            state.saved(path, background)
        return path

    # ---------------------------------------------------------------- loads

    def load(self, step: int = -1) -> bool:
        """torchtitan's ``load(step=-1)``: the scheduled state restored from `step` (-1: the newest
        committed step that verifies, from the ranks' memory when they hold it); False when there
        is none to restore (a fresh start). A step that is unusable for the state is one
        CheckpointError on every rank."""
        from hpcdist.api import state_load

        assert self.state is not None, "load() restores what schedule() named; call schedule() first"
        return state_load.load(self, self.state, step)

    def choose(self, step: int = -1, **how: Any) -> tuple[dict[str, Any], Any, set[int]]:
        """Every rank: the step rank 0 chose (``hpcdist.api.resume_step``, `how` its options), as
        shared; rank 0's verified read of it (None elsewhere, or from memory); the steps the ranks
        hold in memory. A failure is one CheckpointError on every rank."""
        from hpcdist.api.resume_step import on_every_rank

        return on_every_rank(self, step, **how)

    def load_latest(self, into: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the step `choose` picks, or None; every rank loads that one (never a
        newer one a concurrent writer commits), from the ranks' memory when they hold it. Tensors
        are copy-on-write views of the file's pages, verified once per node (``node_read``): a rank
        that writes into one gets its own pages then. With `into`, a state of any layout is filled
        in place from a sharded checkpoint (``sharded_load``); returns (step, into)."""
        if into is not None:
            return load_into(self, into)
        self.wait()  # a background save in flight uses the I/O group too
        shared, latest, held = self.choose(mapped=True)
        step = shared["step"]
        if step is None:
            return None
        if step in held:  # restarted in place: the state from the ranks' memory, not the storage
            state = kept.share(str(self.directory), step, self.ctx.rank, self.ctx.local_rank, self._io_group,
                               self.ctx.log)
            if state is not None:
                self.restore_counts(state.attrs)
                return step, state.state
        loaded = latest or self.store.load(step, mapped=True)  # each rank: only from a folder and file of yours
        self.restore_counts(loaded.attrs)
        from hpcdist.store.sharded import checkpoint as sharded

        if sharded.is_sharded(loaded.attrs):  # the whole state on every rank, read once per node
            from hpcdist.store.sharded.node_read import Sharing

            self._sharing = self._sharing or Sharing(self._io_group)
            whole, stats = self._sharing.read(loaded.path, loaded, own=True)
            self.loaded.append(stats)
            self.ctx.log.info("%s", stats.describe())
            mine = whole.pop(PER_RANK, {}).get(rank_key(self.ctx.rank))
            if per_rank_keys(loaded.attrs, self.ctx.rank) is None:
                self.ctx.log.warning("checkpoint step %d holds no per-rank values of rank %d (saved at another "
                                     "world size)", step, self.ctx.rank)
            return step, {**whole, **(mine or {})}
        return step, decode(loaded.tree["state"])

    def load_sharded(self, path: Path, into: dict[str, Any]) -> dict[str, Any]:
        """Fill `into` (any layout) in place from the committed sharded checkpoint `path`, one
        that rank 0 chose and every rank was told; its root attributes. Every rank reads and
        verifies only the chunks it needs; a failure on any rank is the same CheckpointError on all.
        Like every resume it reads only what no other user could have written (``sharded.load(own=True)``)."""
        from hpcdist.store.sharded import checkpoint as sharded

        self.wait()  # a background save in flight uses the I/O group too
        return sharded.load(path, into, process_group=self._io_group, own=True)

    def restore_counts(self, attrs: Mapping[str, Any]) -> None:
        """The requeue counts a commit recorded (`COUNT_ATTR`) restored, so the bound survives a requeue."""
        count = json.loads(str(attrs.get(COUNT_ATTR, "{}")))
        if count:
            self.ctx.restore_requeues(Requeues(int(count["requeues"]), int(count["timeouts"])), str(count["job_id"]))

    @property
    def io_group(self) -> Any:
        """The checkpoint I/O group (None at one rank)."""
        return self._io_group

    def release(self) -> None:
        """Drop rank 0's claim (no collective: safe at exit and after a failure)."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None


Checkpoints = CheckpointManager  # the name before the manager took train_gpt's policy (issue 65)

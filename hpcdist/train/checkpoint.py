"""``TrainState``: what train_gpt's checkpoint holds, for the one ``CheckpointManager``.

The loop asks once a step, as torchtitan's does, and the manager (``ctx.checkpoints``,
``hpcdist.api.checkpoints``) decides with the policy made here (`policy`: every
``params.checkpoint.every`` steps, the last step, a preemption or time-out signal agreed by the
ranks, ``params.run_steps``; ``hpcdist.api.save_policy``)::

    checkpointer.save(step, last_step=step == params.steps)
    if checkpointer.stop:
        break

Which step a resume takes is the manager's rule too (the newest committed step that verifies, or
the one the ranks hold in memory after an in-place restart). This module says what goes in
(`TrainState.state_dict`: the tree below, built on rank 0, and on every rank where it is kept in
memory), and ``hpcdist.train.resume`` how it comes back; each commit's time and rate go to the
trackers from here.

The files are ``hpcdist.store`` checkpoints with the GPT's ``/model`` (``hpcdist.model.checkpoint``)
and the trainer's groups:

- ``/optimizer`` (attribute ``param_groups_json``: the optimizer's param groups with parameter
  *names* in place of indices; ``/optimizer/state/<param name>/<key>``: AdamW's ``step``,
  ``exp_avg``, ``exp_avg_sq``), ``/scheduler`` and ``/scaler`` (attribute ``state_json``);
- ``/sampler`` (attributes ``seed``, ``epoch``, ``position`` = samples of the epoch already
  consumed, ``world_size``, ``global_batch``);
- ``/rng/rank_<r>`` (``torch_cpu``, ``torch_cuda`` when used, ``numpy_keys`` + attributes,
  ``python_state`` + attributes: every rank's generators);
- ``/tokenizer``: the token file's tokenizer (``hpcdist.data.tokenizer``), so inference decodes
  with it and a resume with data of another tokenizer is an error;
- ``/train`` (attributes ``tokens_seen``, ``requeues``, ``timeouts``, ``world_size``, ``job_id``,
  ``params_json``) and ``/metrics/<table>`` (``steps``, ``val``, ``checkpoints``: the run's
  metrics so far, one dataset per column, column order in the attribute ``columns_json``).

Under FSDP (``params.parallel``) the model and optimizer are sharded and so is the checkpoint
(``hpcdist.store.sharded.checkpoint``): every rank writes its own shards of ``model.<param name>`` and
``optimizer.state.<param name>.<key>`` (DCP's ``get_state_dict``, a tied head saved once as the
embedding), and the index file holds every group above but ``/model`` and ``/optimizer``, as
plain values rank 0 writes. A resume at any world size reads only each rank's new shard.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.api import kept
from hpcdist.api.save_policy import SavePolicy, stop_every
from hpcdist.api.state import CheckpointState, Source
from hpcdist.data.tokenizer import GROUP as TOKENIZER
from hpcdist.model.checkpoint import MODEL_GROUP, model_attrs, model_tree
from hpcdist.runtime.plain import all_gather_plain, gather_plain
from hpcdist.store import step_of
from hpcdist.train import parallel, resume
from hpcdist.train import state as st
from hpcdist.train.failure import named

if TYPE_CHECKING:
    from hpcdist.api.checkpoints import CheckpointManager
    from hpcdist.store.checkpoint.single import Checkpoint
    from hpcdist.train.run import Run
    from hpcdist.train.step_log import StepLog

__all__ = ["TrainState", "policy", "stop_every"]


def policy(run: Run, log: StepLog) -> SavePolicy:
    """The save-and-stop policy of this start (made after its resume): `log`'s mean step time
    paces the ranks' agreement on a signal."""
    cp = run.params.checkpoint
    return SavePolicy(every=cp.every, start=run.step, run_steps=run.params.run_steps, log_every=run.params.log_every,
                      step_s=lambda: log.step_s, background=cp.background)


class TrainState(CheckpointState):
    """train_gpt's model, optimizer, schedule, data position, generators and metrics."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.sharded = run.sharded
        self.unusable = run.params.checkpoint.if_unusable
        self.tracked = len(run.metrics.rows["checkpoints"])  # rows sent to the trackers (those before this start were)

    def state_dict(self) -> dict[str, Any]:
        """The tree on rank 0 (every rank's generators gathered to it); on every rank in a job that
        keeps it in memory for an in-place restart (``hpcdist.api.kept``), the same tree."""
        r, ctx = self.run, self.run.ctx
        everywhere = kept.wanted() and not r.sharded
        mine = st.rng_tree(ctx.device)
        what = "its random generators' state"
        rngs = all_gather_plain(mine, what=what) if everywhere else gather_plain(mine, dst=0, what=what)
        if not (ctx.is_main or everywhere):
            return {}
        assert rngs is not None
        tree: dict[str, Any] = {}
        if not r.sharded:
            tree = {MODEL_GROUP: model_tree(r.model.state_dict()), "optimizer": st.optimizer_tree(r.model, r.opt)}
        tree |= {
            "scheduler": st.json_state(r.sched),
            "scaler": {"state_json": json.dumps(r.scaler.state_dict() if r.scaler.is_enabled() else {})},
            "sampler": {
                "seed": r.params.seed, "epoch": r.epoch, "position": r.position,
                "world_size": ctx.world_size, "global_batch": r.order.global_batch,
            },
            "rng": {f"rank_{i}": rng for i, rng in enumerate(rngs)},
            "train": {
                "tokens_seen": r.tokens_seen, "requeues": r.requeues, "timeouts": r.timeouts,
                "world_size": ctx.world_size, "job_id": ctx.job_id, "params_json": r.params.model_dump_json(),
            },
            "metrics": r.metrics.to_tree(),
        }
        if r.tokenizer is not None:
            tree[TOKENIZER] = r.tokenizer.to_tree()
        return tree

    def sharded_state_dict(self) -> dict[str, Any]:
        return parallel.checkpoint_state(self.run.model, self.run.opt, self.run.cfg.tied)

    def attrs(self) -> dict[str, Any]:
        return model_attrs(self.run.cfg)

    def epoch(self) -> int:
        return self.run.epoch

    def saved(self, path: Path | None, background: bool) -> None:
        """Rank 0's commits since the last save into the metrics (every rank's alike where the
        tree is kept in memory) and the trackers; the newest committed checkpoint."""
        r = self.run
        checkpoints = r.api.checkpoints
        rows = [(step_of(s.path) or 0, s.bytes, s.seconds, s.mb_per_s, str(s.path))
                for s in checkpoints.committed[r.commits_seen:]]
        r.commits_seen = len(checkpoints.committed)
        if kept.wanted() and not r.sharded:
            rows = checkpoints.share(rows, "its commits")
        for step, nbytes, seconds, rate, where in rows:
            r.metrics.add("checkpoints", step=step, op="write", bytes=nbytes, seconds=seconds, mb_per_s=rate,
                          job_id=r.ctx.job_id)
            r.last_checkpoint = Path(where)
        if not background:
            r.last_checkpoint = path
        self._track()

    def stopping(self, step: int) -> None:
        r = self.run
        r.ctx.log.warning("%s signal received: checkpointing at step %d (%s; %d time-out(s), %d requeue(s) so far)",
                          r.api.stop_signal, step, r.api.stop_kind, r.timeouts, r.requeues)

    def named(self, what: str) -> AbstractContextManager[Any]:
        return named(self.run, what)

    def check(self, checkpoint: Checkpoint, path: Path) -> str | None:
        return resume.check(self.run, checkpoint, path)

    def load_state_dict(self, tree: dict[str, Any], source: Source) -> None:
        resume.restore(self.run, tree, source)
        self.tracked = len(self.run.metrics.rows["checkpoints"])

    def load_sharded(self, manager: CheckpointManager, paths: list[Path]) -> Path:
        return resume.load_shards(self.run, paths)

    def _track(self) -> None:
        """Each checkpoint's save time and rate to the trackers, from the metrics' checkpoint rows."""
        rows = self.run.metrics.rows["checkpoints"]
        for row in rows[self.tracked:]:
            values = dict(zip(("step", "op", "bytes", "seconds", "mb_per_s"), row, strict=False))
            self.run.api.track(int(values["step"]), **{f"checkpoint_{values['op']}_s": values["seconds"],
                                                      f"checkpoint_{values['op']}_mb_per_s": values["mb_per_s"]})
        self.tracked = len(rows)

"""train_gpt's resume: the checkpoint the one ``CheckpointManager`` chose, restored on every rank.

Which step is the manager's rule (``hpcdist.api.resume_step``: the newest committed step that
verifies, or the one the ranks hold in memory after an in-place restart, when no file is read),
the same as the user's ``load_latest``. What is train_gpt's own: whether to resume at all
(``params.checkpoint.resume`` on the job's first start), what to do when files are there but none is
usable (``if_unusable``), the test of the chosen file before any tensor is read (`check`: model
shapes, DDP or FSDP, tokenizer), the restore of what ``hpcdist.train.checkpoint`` wrote (`restore`),
a resume at another world size (`_realign`) and ``params.init``'s weights for a fresh start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.api import kept
from hpcdist.data.tokenizer import GROUP as TOKENIZER
from hpcdist.data.tokenizer import mismatch
from hpcdist.errors import CheckpointError
from hpcdist.model.checkpoint import load_model_state, state_dict_of
from hpcdist.model.shapes import MODEL_GROUP, check_shapes, is_sharded, parameter_shapes, shapes_in
from hpcdist.runtime.requeue import Requeues
from hpcdist.store import read as read_checkpoint
from hpcdist.store.checkpoint.discovery import resolve
from hpcdist.train import parallel
from hpcdist.train import state as st
from hpcdist.train.metrics import Metrics

if TYPE_CHECKING:
    from hpcdist.api.state import CheckpointState, Source
    from hpcdist.store.checkpoint.single import Checkpoint
    from hpcdist.train.run import Run


def start_from_init(run: Run) -> None:
    """Every rank loads ``params.init``'s weights (checksums verified): fine-tuning's starting point."""
    assert run.params.init is not None
    path = resolve(run.params.init)
    _, state = load_model_state(path)
    if run.sharded:
        parallel.load_full_model(run.model, state)  # each rank keeps its shard
    else:
        run.model.load_state_dict(state)
    run.ctx.log.info("starting from the weights of %s (params.init)", path)


def _first_start(run: Run) -> bool:
    """Whether this is the job's first start, where ``resume: false`` applies: not a requeue
    (Slurm's restart count; on the local site, whose controller keeps the job id, a newest
    checkpoint this same job wrote)."""
    if run.api.restarts:
        run.ctx.log.warning("requeued (restart %d): resuming; params.checkpoint.resume=false applies to the "
                            "job's first start only", run.api.restarts)
        return False
    latest = run.api.checkpoints.store.latest()
    try:
        ours = latest is not None and read_checkpoint(latest, groups=("train",), verify=False
                                                      ).tree["train"]["job_id"] == run.ctx.job_id
    except (CheckpointError, KeyError):
        ours = False
    if ours:
        run.ctx.log.warning("requeued (%s was written by this job): resuming; params.checkpoint.resume=false "
                            "applies to the job's first start only", latest)
    return not ours


def resume(run: Run, state: CheckpointState) -> None:
    """Every rank restores the checkpoint the manager chose (checksums verified, or from the ranks'
    memory) into `state` (``hpcdist.train.checkpoint.TrainState``, which the loop makes: it calls
    this module's checks and restore), or starts fresh: from ``params.init``'s weights when given."""
    ctx, checkpoints = run.ctx, run.api.checkpoints
    checkpoints.schedule(None, state)
    fresh = ""
    if ctx.is_main and not run.params.checkpoint.resume and _first_start(run):
        fresh = "params.checkpoint.resume is false"
    fresh = checkpoints.share(fresh, "whether to resume")
    if fresh:  # what is there moves to previous/ (one line): a requeue before this run's first commit cannot resume it
        if ctx.is_main:
            checkpoints.store.start_run(why=fresh)
    elif checkpoints.load():
        return
    elif ctx.is_main:
        checkpoints.store.start_run()
    ctx.log.info("starting fresh: no checkpoint to resume from in %s", ctx.checkpoint_dir)
    if run.params.init is not None:
        start_from_init(run)


def check(run: Run, checkpoint: Checkpoint, path: Path) -> str | None:
    """Rank 0: why the chosen checkpoint `path` cannot resume this run, before any tensor is used:
    its model's shapes, DDP or FSDP, its tokenizer. Judged on the read that verified it (a sharded
    checkpoint's shapes from the index it holds)."""
    written_sharded = is_sharded(checkpoint.attrs)
    try:
        check_shapes(path, parameter_shapes(run.cfg), shapes_in(checkpoint))
    except CheckpointError as exc:
        return str(exc)
    if written_sharded != run.sharded:
        kinds = ("FSDP (sharded)", "DDP (whole)") if written_sharded else ("DDP (whole)", "FSDP (sharded)")
        return (f"{path} was written by a {kinds[0]} run and this run is {kinds[1]}: resume with "
                f"the params.parallel that wrote it (any world size), or use a fresh checkpoint directory")
    recorded = checkpoint.tree.get(TOKENIZER)
    wrong = mismatch(run.tokenizer, run.params.data, recorded, path) if recorded and run.tokenizer else None
    if wrong:  # a checkpoint from before tokenizers travelled records none: nothing to compare
        return wrong + " (or use a fresh checkpoint directory)"
    return None


def restore(run: Run, tree: dict[str, Any], source: Source) -> None:
    """Every rank's state from `tree`, the checkpoint of ``source.step`` (its sharded model and
    optimizer already filled by `load_shards`)."""
    ctx = run.ctx
    if not run.sharded:
        run.model.load_state_dict(state_dict_of(tree[MODEL_GROUP]))
        st.load_optimizer(run.model, run.opt, tree["optimizer"])
    st.load_json_state(run.sched, tree["scheduler"])
    st.rebase_schedule(run.sched, run.peak_lr)
    scaler_state = json.loads(str(tree["scaler"]["state_json"]))
    if scaler_state and run.scaler.is_enabled():
        run.scaler.load_state_dict(scaler_state)
    sampler = tree["sampler"]
    run.step, run.epoch = source.step, int(sampler["epoch"])
    run.position = int(sampler["position"])
    train = tree["train"]
    run.tokens_seen = int(train["tokens_seen"])
    run.api.restore_requeues(Requeues(int(train["requeues"]), int(train["timeouts"])), str(train["job_id"]))
    same_world = int(sampler["world_size"]) == ctx.world_size
    if not same_world:
        _realign(run, int(sampler["global_batch"]))
    rng = tree.get("rng", {}).get(f"rank_{ctx.rank}")
    if rng is not None and same_world:
        st.load_rng(rng, ctx.device)
    else:
        ctx.log.warning(
            "checkpoint %s was written by %s ranks, this run has %d: per-rank random state is reseeded, "
            "so the continuation is not bit-identical", source.path, sampler["world_size"], ctx.world_size,
        )
    run.metrics = Metrics.from_tree(tree.get("metrics", {}))
    nbytes, seconds = source.bytes, source.seconds
    if kept.wanted() and not run.sharded:  # every rank's metrics alike: the tree each keeps is rank 0's
        nbytes, seconds = run.api.checkpoints.share((nbytes, seconds), "its read of the checkpoint")
    op = "memory" if source.memory else "read"
    run.metrics.add("checkpoints", step=run.step, op=op, bytes=nbytes, seconds=seconds,
                    mb_per_s=nbytes / 1e6 / seconds if seconds > 0 else 0.0, job_id=ctx.job_id)
    run.last_checkpoint = source.path
    how = "from the ranks' memory, no file read" if source.memory else "checksums verified"
    ctx.log.info(
        "resumed from %s: step %d, epoch %d, %s %.1f MB at %.0f MB/s (%s)", source.path, run.step, run.epoch,
        "took" if source.memory else "read", source.bytes / 1e6, source.mb_per_s, how,
    )


def load_shards(run: Run, paths: list[Path]) -> Path:
    """The model and optimizer from the first of `paths` (sharded, newest first) whose shards
    verify; which one. Each rank reads and verifies the chunks of its own shard, at any world size;
    a chunk that fails its checksum fails the load on every rank alike (DCP gathers the outcome), so
    all go on to the same older step, naming what failed."""
    state = parallel.checkpoint_state(run.model, run.opt, run.cfg.tied)
    for i, path in enumerate(paths):
        try:
            run.api.checkpoints.load_sharded(path, state)
        except CheckpointError as exc:
            if i == len(paths) - 1:
                raise
            run.ctx.log.warning("checkpoint %s not loaded: %s; trying %s", path, exc, paths[i + 1])
            continue
        parallel.load_checkpoint_state(run.model, run.opt, state, run.cfg.tied)
        return path
    raise AssertionError("no path given")


def _realign(run: Run, written_batch: int) -> None:
    """Data parallel resumes at any world size: model and optimizer state do not depend on it.
    The lr follows this run's schedule (``rebase_schedule``), the data order goes on from the
    same sample of the same epoch, or, when a whole new global batch no longer fits in the epoch,
    from the next epoch's start (each rank gets a full micro-batch); tokens seen go on counting."""
    before = (run.epoch, run.position)
    if run.order.epoch_ends_before(run.position):
        run.epoch, run.position = run.epoch + 1, 0
    run.ctx.log.warning(
        "resuming at another world size: %d ranks, global batch %d -> %d sequences, peak lr %.3g; data order "
        "from epoch %d sample %d (the checkpoint stopped at epoch %d sample %d)", run.ctx.world_size, written_batch,
        run.order.global_batch, run.peak_lr, run.epoch, run.position, *before,
    )



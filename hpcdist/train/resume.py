"""The training run's checkpoints: rank 0 picks the one to resume from, every rank restores it,
and rank 0 writes and commits a new one with every rank's generators.

Writing, the background saves, retention and the directory claim are the public API's
``ctx.checkpoints`` (``save_tree``: the tree below at the file's root, where ``infer_gpt`` and
``hpcdist.model.checkpoint`` read ``/model``). Choosing the checkpoint stays here: the run's
policy (``resume``, ``if_unusable``, the model-shape check before any tensor is read) is not
``load_latest``'s, which takes the newest that verifies or nothing.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.data.tokenizer import GROUP as TOKENIZER
from hpcdist.data.tokenizer import mismatch
from hpcdist.errors import CheckpointError
from hpcdist.model.checkpoint import (
    MODEL_GROUP,
    check_shapes,
    is_sharded,
    load_model_state,
    model_attrs,
    model_tree,
    parameter_shapes,
    state_dict_of,
    stored_shapes,
)
from hpcdist.runtime.plain import gather_plain
from hpcdist.runtime.requeue import Requeues
from hpcdist.store import read as read_checkpoint
from hpcdist.store import step_of
from hpcdist.store.checkpoint.directory import POINTER
from hpcdist.store.checkpoint.discovery import resolve
from hpcdist.store.checkpoint.owned import shown
from hpcdist.store.checkpoint.single import read_header
from hpcdist.train import parallel
from hpcdist.train import state as st
from hpcdist.train.metrics import Metrics

if TYPE_CHECKING:
    from hpcdist.train.run import Run


def choose_checkpoint(run: Run) -> dict[str, Any]:
    """Rank 0's decision: the checkpoint to resume from, or an error every rank raises."""
    cp = run.params.checkpoint
    store = run.api.checkpoints.store
    if not cp.resume and _first_start(run):
        # what is there moves to previous/ (one line): a requeue before this run's first commit cannot resume it
        store.start_run(why="params.checkpoint.resume is false")
        return {"path": None}
    with store.opened() as here:  # only a folder of yours, each file read through it (``owned``)
        choice = _choose(run, here)
    if "error" in choice:  # named as the user names the folder, not by its descriptor
        choice["error"] = shown(choice["error"], here, store.directory)
    return choice


def _choose(run: Run, here: Path) -> dict[str, Any]:
    """`choose_checkpoint` in the checkpoint folder held open as `here`."""
    ctx, cp = run.ctx, run.params.checkpoint
    store = run.api.checkpoints.store
    directory = store.directory
    found = store.scan(within=here)
    for line in found.report():
        ctx.log.warning(line)
    removed = store.remove_temporaries()
    if removed:
        ctx.log.warning("removed %d temporary file(s) left by killed writers in %s", len(removed), directory)
    if found.latest is None:
        unusable = bool(found.skipped) or (directory / POINTER).exists()
        if unusable and cp.if_unusable == "error":
            reasons = "; ".join(found.report())
            return {
                "error": f"no usable checkpoint in {directory} ({reasons}); fix or remove them, or set "
                f"params.checkpoint.if_unusable=start_fresh to start over"
            }
        if unusable:
            ctx.log.warning("no usable checkpoint in %s: starting fresh (params.checkpoint.if_unusable)", directory)
        store.start_run()
        return {"path": None}
    latest = here / found.latest.name  # the file that was checked, whatever is renamed meanwhile
    try:
        check_shapes(found.latest, parameter_shapes(run.cfg), stored_shapes(latest))
    except CheckpointError as exc:
        return {"error": str(exc)}
    written_sharded = is_sharded(read_header(latest, MODEL_GROUP).attrs)
    if written_sharded != run.sharded:
        kinds = ("FSDP (sharded)", "DDP (whole)") if written_sharded else ("DDP (whole)", "FSDP (sharded)")
        return {"error": f"{found.latest} was written by a {kinds[0]} run and this run is {kinds[1]}: resume with "
                f"the params.parallel that wrote it (any world size), or use a fresh checkpoint directory"}
    recorded = read_checkpoint(latest, groups=(TOKENIZER,)).tree.get(TOKENIZER)
    wrong = mismatch(run.tokenizer, run.params.data, recorded, found.latest) if recorded and run.tokenizer else None
    if wrong:  # a checkpoint from before tokenizers travelled records none: nothing to compare
        return {"error": wrong + " (or use a fresh checkpoint directory)"}
    store.continue_run(found.run_id or "")  # its run: this run's commits and pruning go on with its files
    # a sharded checkpoint's shards are verified as they are read: the older ones of its run, should they not
    older = [str(store.path(s)) for s in reversed(store.steps()) if store.path(s) != found.latest]
    return {"path": str(found.latest), "older": older if written_sharded else []}


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


def _decide(run: Run) -> dict[str, Any]:
    """`choose_checkpoint`, with any failure (an unreadable directory) an error every rank raises."""
    try:
        return choose_checkpoint(run)
    except CheckpointError as exc:  # a folder another user could have written: one line naming it
        return {"error": str(exc)}
    except Exception as exc:
        where = run.api.checkpoints.directory
        return {"error": f"choosing a checkpoint in {where} failed: {type(exc).__name__}: {exc}"}


def resume(run: Run) -> None:
    """Every rank restores the checkpoint rank 0 chose (checksums verified), or starts fresh."""
    ctx = run.ctx
    choice = run.api.checkpoints.share(_decide(run) if ctx.is_main else None, "its choice of checkpoint")
    if "error" in choice:
        raise CheckpointError(choice["error"])
    if choice["path"] is None:
        ctx.log.info("starting fresh: no checkpoint to resume from in %s", ctx.checkpoint_dir)
        if run.params.init is not None:
            start_from_init(run)
        return
    path = Path(choice["path"])
    if run.sharded:  # each shard read through the checked folder (``sharded.load(own=True)``)
        path = _load_shards(run, [path, *map(Path, choice["older"])])
    # each rank reads it through its checkpoint folder, checked and held open: yours, whatever is renamed
    loaded = run.api.checkpoints.store.load(step_of(path) or 0)  # a sharded checkpoint's index: all but shards
    tree = loaded.tree
    if not run.sharded:
        run.model.load_state_dict(state_dict_of(tree[MODEL_GROUP]))
        st.load_optimizer(run.model, run.opt, tree["optimizer"])
    st.load_json_state(run.sched, tree["scheduler"])
    st.rebase_schedule(run.sched, run.peak_lr)
    scaler_state = json.loads(tree["scaler"]["state_json"])
    if scaler_state and run.scaler.is_enabled():
        run.scaler.load_state_dict(scaler_state)
    sampler = tree["sampler"]
    run.step, run.epoch = loaded.step, int(sampler["epoch"])
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
            "so the continuation is not bit-identical", path, sampler["world_size"], ctx.world_size,
        )
    run.metrics = Metrics.from_tree(tree.get("metrics", {}))
    run.metrics.add(
        "checkpoints", step=run.step, op="read", bytes=loaded.bytes, seconds=loaded.seconds,
        mb_per_s=loaded.mb_per_s, job_id=ctx.job_id,
    )
    run.last_checkpoint = path
    ctx.log.info(
        "resumed from %s: step %d, epoch %d, read %.1f MB at %.0f MB/s (checksums verified)",
        path, run.step, run.epoch, loaded.bytes / 1e6, loaded.mb_per_s,
    )


def _load_shards(run: Run, paths: list[Path]) -> Path:
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


def save(run: Run, *, final: bool = True) -> Path | None:
    """Every rank's RNG to rank 0, which writes and commits; all ranks learn the outcome.

    With ``params.checkpoint.background`` and not `final`, rank 0 blocks only while it copies the
    state to host memory; the write and the commit go on in a thread while training continues.
    Each save first waits for the one before, so a background failure stops the run at the next
    save, and the `final` save (the last step, or before leaving on a signal) is always waited
    for: a run never ends with a checkpoint in flight. Returns the newest committed checkpoint.
    """
    ctx = run.ctx
    rngs = gather_plain(st.rng_tree(ctx.device), dst=0, what="its random generators' state")
    tree: dict[str, Any] = {}
    if ctx.is_main:
        assert rngs is not None
        if not run.sharded:
            tree = {MODEL_GROUP: model_tree(run.model.state_dict()), "optimizer": st.optimizer_tree(run.model, run.opt)}
        tree |= {
            "scheduler": st.json_state(run.sched),
            "scaler": {"state_json": json.dumps(run.scaler.state_dict() if run.scaler.is_enabled() else {})},
            "sampler": {
                "seed": run.params.seed, "epoch": run.epoch, "position": run.position,
                "world_size": ctx.world_size, "global_batch": run.order.global_batch,
            },
            "rng": {f"rank_{r}": rng for r, rng in enumerate(rngs)},
            "train": {
                "tokens_seen": run.tokens_seen, "requeues": run.requeues, "timeouts": run.timeouts,
                "world_size": ctx.world_size, "job_id": ctx.job_id, "params_json": run.params.model_dump_json(),
            },
            "metrics": run.metrics.to_tree(),
        }
        if run.tokenizer is not None:
            tree[TOKENIZER] = run.tokenizer.to_tree()
    background = run.params.checkpoint.background and not final
    checkpoints = run.api.checkpoints
    if run.sharded:  # every rank writes its shards; rank 0's small groups go into the index
        state = parallel.checkpoint_state(run.model, run.opt, run.cfg.tied)
        path = checkpoints.save(run.step, state, attrs=model_attrs(run.cfg), background=background, sharded=True,
                                index=tree if ctx.is_main else None)
    else:
        path = checkpoints.save_tree(run.step, tree, epoch=run.epoch, attrs=model_attrs(run.cfg),
                                     background=background)
    for stats in checkpoints.committed[run.commits_seen:]:  # rank 0's commits since the last save
        run.metrics.add(
            "checkpoints", step=step_of(stats.path) or 0, op="write", bytes=stats.bytes, seconds=stats.seconds,
            mb_per_s=stats.mb_per_s, job_id=ctx.job_id,
        )
        run.last_checkpoint = stats.path
    run.commits_seen = len(checkpoints.committed)
    if not background:
        run.last_checkpoint = path
    return run.last_checkpoint

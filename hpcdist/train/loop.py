"""The ``train_gpt`` runner: data-parallel training that resumes bit for bit after preemption.

The first user of the public API (``hpcdist.api``): the run's ``Context`` claims the checkpoint
directory, saves (in the background between the final ones), tells when to stop and requeues.
Every rank builds the same model from the seed (under FSDP2 only its own shard of it), the
checkpoint manager picks the checkpoint to resume from (the newest committed one that verifies, or
the ranks' memory after an in-place restart), then all ranks train under DDP or FSDP2
(``params.parallel``, ``hpcdist.train.parallel``). This module owns the build, the step, the
validation and the loop, which reads like torchtitan's: after each step it asks
``checkpointer.save(step, last_step=...)``, and the one ``CheckpointManager`` (``ctx.checkpoints``,
with ``hpcdist.train.checkpoint``'s policy and state) decides whether the step saves and whether
the loop stops (a preemption or time-out signal, ``run_steps``); on a signal the job requeues, up
to ``preemption.max_requeues`` times for time-outs. Rank 0's ``results`` hold the metrics, written
when the run ends. A step does not wait for the device: its loss and gradient norm stay
there until the step log flushes (``hpcdist.train.step_log``), and the model's blocks and head are
compiled on GPUs (``hpcdist.train.speed``). A failed collective is named by
``hpcdist.train.failure``; resume, result and state are their own modules.
"""

from __future__ import annotations

import os
import random
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpcdist.api.launch import from_job
from hpcdist.data.dataset import DistributedOrder, TokenWindows, eval_samples
from hpcdist.data.tokens import describe
from hpcdist.errors import JobError
from hpcdist.model.gpt import GPTConfig
from hpcdist.train import parallel, speed
from hpcdist.train.checkpoint import TrainState, policy
from hpcdist.train.failure import named
from hpcdist.train.metrics import add_rank_log_file, perplexity
from hpcdist.train.params import TrainParams, effective_compile, effective_precision, model_config
from hpcdist.train.result import fill_result
from hpcdist.train.resume import resume
from hpcdist.train.run import Run
from hpcdist.train.schedule import lr_factor, scaled_lr
from hpcdist.train.step_log import StepLog

if TYPE_CHECKING:
    from hpcdist.api import Context
    from hpcdist.runtime.job_rank import JobRank


def deterministic_kernels() -> None:
    """Kernels that give the same bits on every run: cuBLAS with a fixed workspace (set before its
    first use in this process), torch's deterministic algorithms (an op without one raises), and
    SDPA's math backend (the fused backward kernels accumulate with atomics)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def build(ctx: JobRank, api: Context, params: TrainParams) -> Run:
    info = describe(params.data)
    cfg: GPTConfig = model_config(params, info.vocab_size)
    cache = speed.compile_cache(ctx) if effective_compile(params.compile, ctx.device.type) else None
    if params.deterministic:
        deterministic_kernels()
    speed.fast_matmuls(ctx.device)
    bf16_ok = ctx.device.type == "cuda" and torch.cuda.is_bf16_supported()
    precision = effective_precision(params.precision, ctx.device.type, bf16_ok)
    torch.manual_seed(params.seed)  # the same initial weights on every rank
    compile_parts = partial(speed.compile_model, deterministic=params.deterministic) if cache else None
    model, net = parallel.build(cfg, ctx, params.parallel, precision, compile_parts)  # FSDP2: each rank's shard only
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    o = params.optim
    b = params.batch
    train = TokenWindows(params.data, "train", cfg.context)
    val = TokenWindows(params.data, "val", cfg.context)
    order = DistributedOrder(len(train), ctx.world_size, ctx.rank, b.micro, b.accum, params.seed)
    peak = scaled_lr(o.lr, o.lr_scaling, order.global_batch, o.reference_batch or b.micro * b.accum)
    opt = speed.adamw(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        ctx.device, lr=peak, betas=o.betas, eps=o.eps,
    )
    factor = partial(lr_factor, warmup=o.warmup_steps, total=params.steps, min_ratio=o.min_lr_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=precision == "fp16")
    # Each rank's own generators (dropout): seeded per rank, saved and restored per rank.
    torch.manual_seed(params.seed + 1 + ctx.rank)
    np.random.seed(params.seed + 1 + ctx.rank)
    random.seed(params.seed + 1 + ctx.rank)
    return Run(api, params, cfg, model, net, opt, sched, scaler, order, train, val, peak, precision,
               mixed=parallel.mixed_precision(ctx, params.parallel, precision), tokenizer=info.load_tokenizer(),
               compile_cache=cache)


# ---------------------------------------------------------------- steps


def train_step(run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `accum` micro-batches; this rank's mean loss and the gradient norm,
    as device tensors: nothing here waits for the device (``hpcdist.train.step_log``)."""
    run.net.train()
    micro = run.order.step_samples(run.epoch, run.position)
    device = run.ctx.device
    total = torch.zeros((), device=device)
    last = len(micro) - 1
    for m, idx in enumerate(micro):
        # from pinned memory on CUDA: a copy from pageable memory may wait for the device (CUDA's
        # "API synchronization behavior"); pinned, the step queues it and goes on
        x, y = (_pinned(t, device).to(device, non_blocking=True) for t in run.train.batch(idx))
        # Reduce only on the last micro-batch: the others accumulate locally.
        with parallel.gradient_sync(run.net, m == last):
            with run.autocast():
                loss = run.net(x, y)  # the head and the loss together, over the real vocabulary
            run.scaler.scale(loss / len(micro)).backward()
        total += loss.detach()
    run.scaler.unscale_(run.opt)
    clip = run.params.optim.grad_clip
    if run.sharded:  # the norm over every rank's shard
        grad_norm = parallel.clip_gradients(list(run.model.parameters()), clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip if clip is not None else float("inf"))
    run.scaler.step(run.opt)
    run.scaler.update()
    run.opt.zero_grad(set_to_none=True)
    run.sched.step()
    return total / len(micro), grad_norm


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t


@torch.no_grad()
def evaluate(run: Run) -> float:
    run.model.eval()
    device = run.ctx.device
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    ctx, p = run.ctx, run.params
    batches = eval_samples(len(run.val), ctx.world_size, ctx.rank, p.batch.micro, p.eval.batches)
    for idx in batches:
        if len(idx) == 0:
            continue
        x, y = (t.to(device) for t in run.val.batch(idx))
        with run.autocast():
            logits = run.model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        acc += torch.stack([loss.double(), torch.tensor(float(y.numel()), device=device, dtype=torch.float64)])
    dist.all_reduce(acc)
    run.model.train()
    return float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")


# ---------------------------------------------------------------- the run


def run(ctx: JobRank, params: TrainParams) -> dict[str, Any]:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    log_file = ctx.paths.rank_log(ctx.rank)
    handler = add_rank_log_file(log_file)
    if params.checkpoint.checksum is not None:
        from hpcdist.store import checksum

        checksum.use(params.checkpoint.checksum)
    api = from_job(ctx, None, params.checkpoint.keep_last, log=ctx.log, io_timeout_s=params.checkpoint.io_timeout_s)
    try:
        try:
            api.checkpoints  # noqa: B018 - rank 0 claims the directory now: a held one fails every rank at once
            t0 = time.perf_counter()
            r = build(ctx, api, params)
            ctx.timings["train_build"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            resume(r, TrainState(r))
            ctx.timings["train_resume"] = time.perf_counter() - t0
            try:
                return loop(r)
            finally:
                r.train.close()
                r.val.close()
        except Exception:
            api.release()  # a requeue (SystemExit) keeps the claim: the requeued job, same id, takes it back
            raise
    finally:
        import logging

        logging.getLogger("hpcdist").removeHandler(handler)
        handler.close()


def loop(r: Run) -> dict[str, Any]:
    """Train to ``params.steps``, or until the checkpoint manager says stop (a signal, ``run_steps``)."""
    params = r.params
    log = StepLog(r)
    checkpointer = r.api.checkpoints  # the one CheckpointManager: it decides whether a step saves and stops
    checkpointer.schedule(policy(r, log), TrainState(r))
    comm = "FSDP all-gather/reduce-scatter" if r.sharded else "gradient all_reduce"
    try:
        while r.step < params.steps:
            log.start()
            lr = float(r.opt.param_groups[0]["lr"])  # what this step uses: the metric is the optimizer's, not a formula
            with named(r, f"training step {r.step + 1} ({comm})"):
                loss, grad_norm = train_step(r)
            r.step += 1
            r.position += r.order.global_batch
            r.tokens_seen += r.tokens_per_step
            epoch_ends = r.order.epoch_ends_before(r.position)
            validates = bool(params.eval.every and r.step % params.eval.every == 0) or r.step == params.steps
            last = r.step == params.steps
            log.add(lr, loss, grad_norm, flush=epoch_ends or validates or checkpointer.due(r.step, last_step=last))
            if epoch_ends:
                _next_epoch(r)
            if validates:
                _validate(r)
            checkpointer.save(r.step, last_step=last)
            if checkpointer.stop:
                break
    finally:
        log.close()
    if checkpointer.stop == "preempted":
        _requeue(r)
    complete = r.step >= params.steps
    result = _finish(r, complete)
    return _summary(r, complete, result, checkpointer.stop)


def _next_epoch(r: Run) -> None:
    """The data order's epoch ended at this step: rank 0 says how it went, the next one begins."""
    if r.ctx.is_main:
        ep = r.metrics.epochs()
        i = int(np.flatnonzero(ep["epoch"] == r.epoch)[-1]) if len(ep["epoch"]) else 0
        r.ctx.log.info(
            "epoch %d done: mean loss %.4f (ppl %.2f), %.0f tok/s",
            r.epoch, ep["mean_loss"][i], ep["ppl"][i], ep["tokens_per_s"][i],
        )
    r.epoch, r.position = r.epoch + 1, 0


def _validate(r: Run) -> None:
    """The validation loss at this step, into the metrics, the trackers and rank 0's log."""
    with named(r, f"validation at step {r.step} (all_reduce)"):
        val = evaluate(r)
    r.metrics.add("val", step=r.step, loss=val, ppl=perplexity(val))
    r.api.track(r.step, val_loss=val)
    if r.ctx.is_main:
        r.ctx.log.info("step %d: validation loss %.4f (ppl %.2f)", r.step, val, perplexity(val))


def _finish(r: Run, complete: bool) -> Path | None:
    """Close the run's context: rank 0's result is written, the claim released; rank 0's result path."""
    if r.ctx.is_main:
        fill_result(r, complete)
        if complete:
            r.api.result_artifacts.append(partial(_loss_plot, folder=r.ctx.paths.tracking))
    r.api.close()
    if not r.ctx.is_main:
        return None
    r.ctx.log.info("result written to %s", r.api.results.path)
    return r.api.results.path


def _loss_plot(result: Path, folder: Path) -> list[Path]:
    """The loss plot `hpcdist report --plot` makes, for the trackers (in the job's tracking folder)."""
    from hpcdist.train.report import plot_train

    return plot_train(result, folder)


def _requeue(r: Run) -> None:
    refusal = r.api.requeue_refusal(r.last_checkpoint)
    if refusal:
        _finish(r, complete=False)
        raise JobError(f"{refusal} (step {r.step} of {r.params.steps})")
    if not r.api.can_requeue:
        raise JobError(
            f"preempted at step {r.step}; checkpoint {r.last_checkpoint} is committed but this launch was not "
            f"started by submitit and cannot requeue itself: resubmit the same spec to resume"
        )
    r.api.requeue()  # a barrier first: the checkpoint is committed and every rank knows it


def _summary(r: Run, complete: bool, result: Path | None, stop: str) -> dict[str, Any]:
    steps = r.metrics.columns("steps")
    val = r.metrics.columns("val")
    out: dict[str, Any] = {
        "step": r.step,
        "complete": complete,
        "loss": round(float(steps["loss"][-1]), 5) if len(steps["loss"]) else None,
        "val_loss": round(float(val["loss"][-1]), 5) if len(val["loss"]) else None,
        "checkpoint": str(r.last_checkpoint) if r.last_checkpoint else None,
        "requeues": r.requeues,
    }
    if stop == "run_steps":
        out["stopped"] = f"run_steps={r.params.run_steps} reached; resubmit to continue"
    if result is not None:
        out["result"] = str(result)
    return out

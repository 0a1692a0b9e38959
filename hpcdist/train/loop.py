"""The ``train_gpt`` runner: data-parallel training that resumes bit for bit after preemption.

The first user of the public API (``hpcdist.api``): the run's ``Context`` claims the checkpoint
directory, saves (in the background between the final ones), tells when to stop and requeues.
Every rank builds the same model from the seed (under FSDP2 only its own shard of it), rank 0
picks the checkpoint to resume from (the newest committed one that verifies) and tells the
others, then all ranks train under DDP or FSDP2 (``params.parallel``, ``hpcdist.train.parallel``).
At each step boundary the ranks agree on ``should_stop()`` (the site's signal or SIGTERM); when
it is set they write a checkpoint and the job requeues, up to ``preemption.max_requeues`` times
for time-outs. Rank 0's ``results`` hold the metrics, written when the run ends.
A step does not wait for the device: its loss and gradient norm stay there until the loop logs
(``hpcdist.train.window``), and the model's blocks and head are compiled on GPUs
(``hpcdist.train.speed``). It runs under 400 lines: the step loop, its failure naming and the
stop/requeue ending are one flow, read top to bottom (resume, result and state are their own modules).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpcdist.api.launch import from_job
from hpcdist.console import Progress
from hpcdist.data.dataset import DistributedOrder, TokenWindows, eval_samples
from hpcdist.data.tokens import describe
from hpcdist.errors import HpcdistError, JobError
from hpcdist.model.gpt import GPTConfig
from hpcdist.runtime import abort
from hpcdist.runtime.rollcall import failure_message
from hpcdist.train import parallel, speed
from hpcdist.train.metrics import add_rank_log_file, perplexity
from hpcdist.train.params import TrainParams, effective_compile, effective_precision, model_config
from hpcdist.train.result import fill_result
from hpcdist.train.resume import resume, save
from hpcdist.train.run import Run
from hpcdist.train.schedule import lr_factor, scaled_lr
from hpcdist.train.window import Window, stop_every

if TYPE_CHECKING:
    from hpcdist.api import Context
    from hpcdist.runtime.context import JobContext


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


def build(ctx: JobContext, api: Context, params: TrainParams) -> Run:
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
    as device tensors: nothing here waits for the device (``hpcdist.train.window``)."""
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


def run(ctx: JobContext, params: TrainParams) -> dict[str, Any]:
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
            resume(r)
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
    ctx, params = r.ctx, r.params
    start_step = r.step
    r.tracked_checkpoints = len(r.metrics.rows["checkpoints"])  # those before this start were sent by it
    progress = (
        Progress("train", params.steps, start=r.step, log=ctx.log, every=params.log_every) if ctx.is_main else None
    )
    if ctx.is_main:
        ctx.log.info(
            "training %s: %.2fM parameters, %d steps from step %d, global batch %d x %d tokens, peak lr %.3g, %s",
            ctx.spec.name, r.cfg.num_params() / 1e6, params.steps, r.step, r.order.global_batch,
            r.cfg.context, r.peak_lr, r.precision,
        )
    stop = ""
    window, check_every = Window(), 1
    try:
        while r.step < params.steps:
            window.start()
            lr = float(r.opt.param_groups[0]["lr"])  # what this step uses: the metric is the optimizer's, not a formula
            comm = "FSDP all-gather/reduce-scatter" if r.sharded else "gradient all_reduce"
            with _named(r, f"training step {r.step + 1} ({comm})"):
                loss, grad_norm = train_step(r)
            r.step += 1
            r.position += r.order.global_batch
            r.tokens_seen += r.tokens_per_step
            window.add(r.step, r.epoch, lr, r.tokens_seen, loss, grad_norm)
            epoch_ends = r.order.epoch_ends_before(r.position)
            every = params.eval.every
            evaluates = bool(every and r.step % every == 0) or r.step == params.steps
            saves = r.step % params.checkpoint.every == 0 or r.step == params.steps
            run_ends = bool(params.run_steps) and r.step - start_step >= (params.run_steps or 0)
            if (r.step == start_step + 1 or r.step % params.log_every == 0 or epoch_ends or evaluates or saves
                    or run_ends or r.step % check_every == 0):  # a stop is agreed only at these steps
                with _named(r, f"training step {r.step} (loss all_reduce)"):
                    step_s = _flush(r, window, progress, first=r.step == start_step + 1)
                check_every = stop_every(params.log_every, step_s)
            if epoch_ends:
                if ctx.is_main:
                    ep = r.metrics.epochs()
                    i = int(np.flatnonzero(ep["epoch"] == r.epoch)[-1]) if len(ep["epoch"]) else 0
                    ctx.log.info(
                        "epoch %d done: mean loss %.4f (ppl %.2f), %.0f tok/s",
                        r.epoch, ep["mean_loss"][i], ep["ppl"][i], ep["tokens_per_s"][i],
                    )
                r.epoch, r.position = r.epoch + 1, 0
            if evaluates:
                with _named(r, f"validation at step {r.step} (all_reduce)"):
                    val = evaluate(r)
                r.metrics.add("val", step=r.step, loss=val, ppl=perplexity(val))
                r.api.track(r.step, val_loss=val)
                if ctx.is_main:
                    ctx.log.info("step %d: validation loss %.4f (ppl %.2f)", r.step, val, perplexity(val))
            stopping = False
            if r.step % check_every == 0 or saves or run_ends:
                with _named(r, f"training step {r.step} (stop agreement all_reduce)"):
                    stopping = r.api.should_stop()
            if stopping and r.step < params.steps:
                stop = "preempted"
            elif stopping:  # at the last step: just finish
                r.api.ignore_stop()
            elif run_ends and r.step < params.steps:
                stop = "run_steps"
            if stop == "preempted":
                _count_preemption(r)
            if stop or saves:
                how = "sharded checkpoint save" if r.sharded else "checkpoint gather to rank 0"
                with _named(r, f"training step {r.step} ({how})"):
                    save(r, final=bool(stop) or r.step == params.steps)
                _track_checkpoints(r)
            if stop:
                break
    finally:
        if progress is not None:
            progress.close()
    if stop == "preempted":
        _requeue(r)
    complete = r.step >= params.steps
    result = _finish(r, complete)
    return _summary(r, complete, result, stop)


def _flush(r: Run, window: Window, progress: Progress | None, first: bool) -> float:
    """The window's steps into the metrics and the trackers, and the progress line (the one host
    wait of the window); the mean step time, the same on every rank. The first step of a run is
    its own window, and says how long it took: with compiling, that is mostly compile time."""
    rows, step_s = window.flush(r.ctx.world_size, r.tokens_per_step)
    for row in rows:
        r.metrics.add("steps", ppl=perplexity(row["loss"]), **row)
        r.api.track(row["step"], **{k: v for k, v in row.items() if k != "step"})  # rank 0's, to the trackers
    last = rows[-1]
    if first and r.ctx.is_main:
        why = (f"includes torch.compile's work on the blocks and the head: compiling them, or loading the code "
               f"cached in {r.compile_cache} by an earlier run"
               if r.compile_cache is not None else "eager: no compilation (params.compile)")
        r.ctx.log.info("step %d took %.2f s: %s", last["step"], step_s, why)
    if progress is not None:
        progress.update(last["step"], f"loss {last['loss']:.4f}  lr {last['lr']:.2e}  "
                        f"{last['tokens_per_s']:,.0f} tok/s  grad_norm {last['grad_norm']:.3f}")
    return step_s


def _track_checkpoints(r: Run) -> None:
    """Each checkpoint's save time and rate to the trackers, from the metrics' checkpoint rows."""
    rows = r.metrics.rows["checkpoints"]
    for row in rows[r.tracked_checkpoints:]:
        values = dict(zip(("step", "op", "bytes", "seconds", "mb_per_s"), row, strict=False))
        r.api.track(int(values["step"]), **{f"checkpoint_{values['op']}_s": values["seconds"],
                                           f"checkpoint_{values['op']}_mb_per_s": values["mb_per_s"]})
    r.tracked_checkpoints = len(rows)


def _newest_commit(r: Run) -> Path | None:
    """The checkpoint a resubmission would resume from: the directory's ``latest`` pointer, read
    from shared storage by any rank (a background save commits after the step that made it, so
    the run's own record can lag), else what this rank last saw committed."""
    try:
        return r.api.checkpoints.store.latest() or r.last_checkpoint
    except Exception:  # an unreadable pointer: the error message falls back to the run's record
        return r.last_checkpoint


@contextlib.contextmanager
def _named(r: Run, what: str) -> Iterator[None]:
    """A failed collective becomes a JobError naming the step, the node that stopped answering
    and the last committed checkpoint, from which a resubmission resumes; so does one that NCCL's
    watchdog times out and ends the rank for (``hpcdist.runtime.abort``)."""

    def kept(_: str) -> str:
        committed = _newest_commit(r)
        return f"; resubmit to resume from {committed}" if committed else "; no checkpoint yet"

    try:
        with abort.phase(what, on_timeout=kept):
            yield
    except HpcdistError:
        raise
    except Exception as exc:
        message = failure_message(what, r.ctx.rank, r.ctx.hosts, exc, r.ctx.site, r.ctx.job_id)
        raise JobError(message + kept(message)) from exc


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


def _count_preemption(r: Run) -> None:
    """Say which signal stopped the run and how the API counted it (rank 0 told a time-out from a preemption)."""
    r.ctx.log.warning(
        "%s signal received: checkpointing at step %d (%s; %d time-out(s), %d requeue(s) so far)",
        r.api.stop_signal, r.step, r.api.stop_kind, r.timeouts, r.requeues,
    )


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

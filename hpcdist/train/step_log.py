"""The steps since ``train_gpt`` last looked at its numbers, on the node: their losses and gradient
norms stay on the device until the loop logs (every ``params.log_every`` steps, and before a
validation, a checkpoint or a stop), when one reduction over the ranks and one copy to the host
give every step's row.

A step that asked for its loss as a Python number would wait for the GPU each step (the host
could not queue the next step's kernels meanwhile): the plain loop people compare with reads its
loss only when it prints. So a step's row in ``/train/steps`` is the same as before (each step's
loss, mean over ranks, its gradient norm and lr), and its time is the window's: the seconds from
the window's first step to the host's copy at its end, shared evenly by its steps.

``StepLog`` is the loop's side of it: the window, the progress line, and when to flush (the first
step of a start, every ``params.log_every`` steps, and whenever the loop asks: before an epoch's
end, a validation, and every step at which the checkpoint manager saves or agrees on a stop, so
a checkpoint holds every step's row). Its mean step time paces that agreement
(``hpcdist.api.save_policy``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpcdist.console import Progress
from hpcdist.train.failure import named
from hpcdist.train.metrics import perplexity

if TYPE_CHECKING:
    from hpcdist.train.run import Run


@dataclass
class Window:
    """Steps run since the last flush: each one's (step, epoch, lr, tokens seen) and its loss and
    gradient norm as device tensors (the loss this rank's mean over its micro-batches)."""

    started: float | None = None
    steps: list[tuple[int, int, float, int]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)

    def start(self) -> None:
        """Mark the time a step begins; a window's clock starts at its first step."""
        if self.started is None:
            self.started = time.perf_counter()

    def add(self, step: int, epoch: int, lr: float, tokens_seen: int, loss: torch.Tensor,
            grad_norm: torch.Tensor) -> None:
        self.steps.append((step, epoch, lr, tokens_seen))
        self.losses.append(loss.detach().reshape(()))
        self.norms.append(grad_norm.detach().reshape(()).float())

    def flush(self, world_size: int, tokens_per_step: int) -> tuple[list[dict[str, Any]], float]:
        """Every step's row (``epoch, loss, grad_norm, lr, tokens_per_s, step_time_s, tokens_seen``
        and ``step``), the losses averaged over the ranks (a collective: every rank flushes at the
        same steps); and the mean step time over the ranks, the same number on each. Empties the window.
        A step's loss is the same bits whichever window it is flushed in (every step when a checkpoint
        is saved each step, every ``log_every`` otherwise, a restart's own), so that two runs of one
        spec compare bit for bit (measured: with all_reduce, 300 steps saved every step and saved once
        differed from step 22 on, in the last bits, with the same model)."""
        if not self.steps:
            return [], 0.0
        norm_list = torch.stack(self.norms).tolist()  # the host copy waits for the window's last step
        seconds = time.perf_counter() - (self.started or time.perf_counter())
        values = torch.cat([torch.stack(self.losses).float(),
                            torch.tensor([seconds], dtype=torch.float32, device=self.losses[0].device)])
        if world_size > 1:  # each rank's numbers, added in rank order: all_reduce's order of addition for
            gathered = [torch.empty_like(values) for _ in range(world_size)]  # an element depends on where the
            dist.all_gather(gathered, values)  # tensor splits it, so a step's loss would depend on its window
            values = gathered[0].clone()
            for other in gathered[1:]:
                values += other
        *sums, clock = values.tolist()
        mean_s = clock / world_size / len(self.steps)
        loss_list = [v / world_size for v in sums]
        rows = [{"step": s, "epoch": e, "loss": loss, "grad_norm": norm, "lr": lr,
                 "tokens_per_s": tokens_per_step / mean_s if mean_s > 0 else 0.0, "step_time_s": mean_s,
                 "tokens_seen": seen}
                for (s, e, lr, seen), loss, norm in zip(self.steps, loss_list, norm_list, strict=True)]
        self.started, self.steps, self.losses, self.norms = None, [], [], []
        return rows, mean_s



class StepLog:
    """The loop's numbers on their way out: each step into the window, and at a flush every
    step's row into the run's metrics and the trackers, and rank 0's progress line."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.first = run.step + 1  # the first step of this start: its own window
        self.window = Window()
        self.step_s = 0.0  # the mean step time of the last flush, the same on every rank; 0 before the first
        ctx, params = run.ctx, run.params
        self.progress = (Progress("train", params.steps, start=run.step, log=ctx.log, every=params.log_every)
                         if ctx.is_main else None)
        if ctx.is_main:
            if run.step > 0:
                self._backfill()
            ctx.log.info(
                "training %s: %.2fM parameters, %d steps from step %d, global batch %d x %d tokens, peak lr %.3g, %s",
                ctx.spec.name, run.cfg.num_params() / 1e6, params.steps, run.step, run.order.global_batch,
                run.cfg.context, run.peak_lr, run.precision,
            )

    def _backfill(self) -> None:
        """A restart: the resumed checkpoint's step rows to the trackers, which send those they
        did not take before (an earlier start killed within a second of its steps sent none of
        them; the checkpoint has each)."""
        tracking = self.run.api.tracking_run()
        if tracking is None:
            return
        steps = self.run.metrics.columns("steps")
        names = [c for c in steps if c not in ("step", "ppl")]
        tracking.backfill((int(s), {c: float(steps[c][i]) for c in names}) for i, s in enumerate(steps["step"])
                          if s <= self.run.step)

    def start(self) -> None:
        """A step begins (the window's clock starts at its first)."""
        self.window.start()

    def add(self, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor, *, flush: bool = False) -> None:
        """The step the run just made (``run.step``, its epoch and tokens seen), with the lr it used;
        flushed with the window's others at the first step, every ``log_every`` steps, or when `flush`."""
        r = self.run
        self.window.add(r.step, r.epoch, lr, r.tokens_seen, loss, grad_norm)
        if flush or r.step == self.first or r.step % r.params.log_every == 0:
            with named(r, f"training step {r.step} (loss all_reduce)"):
                self._flush()

    def _flush(self) -> None:
        """The window's steps into the metrics and the trackers, and the progress line (the one host
        wait of the window). The first step of a start is its own window, and says how long it
        took: with compiling, that is mostly compile time."""
        r = self.run
        rows, self.step_s = self.window.flush(r.ctx.world_size, r.tokens_per_step)
        for row in rows:
            r.metrics.add("steps", ppl=perplexity(row["loss"]), **row)
            r.api.track(row["step"], **{k: v for k, v in row.items() if k != "step"})  # rank 0's, to the trackers
        last = rows[-1]
        if last["step"] == self.first and r.ctx.is_main:
            why = (f"includes torch.compile's work on the blocks and the head: compiling them, or loading the code "
                   f"cached in {r.compile_cache} by an earlier run"
                   if r.compile_cache is not None else "eager: no compilation (params.compile)")
            r.ctx.log.info("step %d took %.2f s: %s", last["step"], self.step_s, why)
        if self.progress is not None:
            self.progress.update(last["step"], f"loss {last['loss']:.4f}  lr {last['lr']:.2e}  "
                                 f"{last['tokens_per_s']:,.0f} tok/s  grad_norm {last['grad_norm']:.3f}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

"""A user script on ``hpcdist.init()`` that resumes at any world size: linear regression by SGD on
a global batch of 12 samples a step (fixed by the step number), split across the ranks; the
gradient is summed over the ranks and divided by the global batch, so a run at 4, 3 or 1 ranks
takes the same steps up to float rounding. Checkpoints every `--every` steps, sleeps `--step-s`
a step (to leave a test time to kill a node), and records every step's loss in its result (and
in the job's tracker, where the spec names one). `--hang-rank` hangs at step `--hang-at` of a
run that did not resume; `--comm-error-at` raises a communication error on every rank once;
`--wait-at` holds every rank before that step until the file `--wait-for` exists (no collective
in flight meanwhile: a test makes its fault while the job stands there, whatever the load)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hpcdist

BATCH, FEATURES = 12, 6  # 12 divides among 1, 2, 3, 4 and 6 ranks


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--hang-rank", type=int, default=-1, help="this rank hangs at --hang-at, unless resumed")
    parser.add_argument("--hang-at", type=int, default=0)
    parser.add_argument("--comm-error-at", type=int, default=0,
                        help="every rank raises torch's DistBackendError (as NCCL's errors) at this step, unless "
                        "resumed from the step before it")
    parser.add_argument("--wait-at", type=int, default=0, help="every rank waits before this step ...")
    parser.add_argument("--wait-for", type=Path, default=None, help="... until this file exists")
    args = parser.parse_args()
    ctx = hpcdist.init()
    if ctx.reruns:  # on_rank_failure: in_place, a rank that lived: its module state is the failed run's
        ctx.log.info("this process runs the job again (%d run before)", ctx.reruns)
    w = torch.zeros(FEATURES, 1, dtype=torch.float64)
    start, losses = 0, []
    latest = ctx.checkpoints.load_latest()
    if latest is not None:
        start, state = latest
        w, losses = state["w"].clone(), state["losses"].tolist()
        ctx.log.info("resumed from step %d at world size %d", start, ctx.world_size)
    for step in range(start + 1, args.steps + 1):
        if ctx.rank == args.hang_rank and step == args.hang_at and start == 0:
            ctx.log.info("hanging at step %d", step)
            time.sleep(3600)  # a rank stuck (a GPU that stopped answering): the others' collective times out
        while step == args.wait_at and args.wait_for is not None and not args.wait_for.exists():
            time.sleep(0.1)
        if step == args.comm_error_at and start < step - 1:
            raise dist.DistBackendError(f"NCCL error (injected at step {step}): unhandled system error")
        x, y = batch(step)
        x, y = x[ctx.rank::ctx.world_size], y[ctx.rank::ctx.world_size]
        err = x @ w - y
        both = torch.cat([(2 * x.T @ err).flatten(), (err**2).sum().reshape(1)]) / BATCH
        dist.all_reduce(both)  # summed over the ranks: the global batch's mean gradient and loss
        w -= 0.1 * both[:-1].reshape(FEATURES, 1)
        losses.append(float(both[-1]))
        ctx.track(step, loss=losses[-1])  # to the job's tracker, where its spec names one
        if step % args.every == 0 or step == args.steps:
            ctx.checkpoints.save(step, {"w": w, "losses": torch.tensor(losses, dtype=torch.float64)})
        time.sleep(args.step_s)
    ctx.results.attrs.update(steps=args.steps, final_loss=losses[-1], resumed_from=start,
                             ran_with=ctx.world_size)
    ctx.results.table("loss", {"step": list(range(1, len(losses) + 1)), "loss": losses})
    ctx.close()


if __name__ == "__main__":
    main()

"""The same DDP training as ddp_plain.py, on hpcdist's API: checkpoints and preemption.

    import hpcdist
    ctx = hpcdist.init()      # rank facts, device, process group (any launcher), logger

Run it as a job (`hpcdist submit --site local-slurm --set resources.nodes=2 --wait --
examples/ddp_hpcdist.py --steps 200`) or under plain torchrun / srun / mpirun. On the site's
preemption signal or SIGTERM every rank stops at the same step, the state is committed, and the
job requeues itself; the requeued job resumes from that checkpoint and ends exactly where an
uninterrupted run ends.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hpcdist


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at `step`: the same every run, so a resumed run repeats nothing."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every this many steps")
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep per step (to leave time for a signal)")
    args = parser.parse_args()
    ctx = hpcdist.init()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(ctx.device)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    start, losses = 0, []
    latest = ctx.checkpoints.load_latest()
    if latest is not None:
        start, state = latest
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        losses = list(state["losses"].tolist())
        ctx.log.info("resumed from step %d", start)

    def state() -> dict[str, object]:  # the same on every rank (DDP): each tensor written once across them
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def mine() -> dict[str, object]:  # this rank's own losses come back to this rank
        return {"losses": torch.tensor(losses)}

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, ctx.rank, ctx.device)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        time.sleep(args.step_s)
        if step % args.every == 0 or step == args.steps:
            ctx.checkpoints.save(step, state(), per_rank=mine())
        if ctx.should_stop() and step < args.steps:
            ctx.log.warning("stop requested: checkpointing at step %d and requeueing", step)
            ctx.checkpoints.save(step, state(), per_rank=mine())
            ctx.requeue()
    ctx.results.attrs.update(steps=args.steps, final_loss=losses[-1], resumed_from=start)
    ctx.results.table("loss", {"step": list(range(1, len(losses) + 1)), "loss": losses})
    if ctx.is_main:
        print(f"done: {args.steps} steps on {ctx.world_size} ranks, final loss {losses[-1]:.6f}", flush=True)
    ctx.close()


if __name__ == "__main__":
    main()

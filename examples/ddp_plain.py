"""A plain torchrun-style DDP training script: no hpcdist import anywhere.

It reads RANK, WORLD_SIZE and LOCAL_RANK and lets ``init_process_group`` find MASTER_ADDR and
MASTER_PORT (env://), exactly as under ``torchrun``. hpcdist runs it unchanged:

    hpcdist submit --site local-slurm --set resources.nodes=2 --set resources.tasks_per_node=2 \\
        --wait -- examples/ddp_plain.py --steps 50

A tiny regression model, deterministic data per (step, rank): a few seconds on one core.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at `step`: the same every run, different on every rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    print(f"rank {rank}/{world} (local {local_rank}) on {socket.gethostname()}", flush=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss = torch.zeros(())
    for step in range(1, args.steps + 1):
        x, y = batch(step, rank, device)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    same = checksum.clone()
    dist.all_reduce(same, op=dist.ReduceOp.MAX)
    if not torch.equal(same, checksum):
        raise RuntimeError(f"rank {rank}: parameters differ across ranks ({checksum.item()} vs {same.item()})")
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks, final loss {loss.item():.6f}, "
              f"checksum {checksum.item():.10f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

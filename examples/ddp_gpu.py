"""A torchrun-style DDP training script written for GPUs: no hpcdist import anywhere.

The shape of PyTorch's DDP tutorial (``multigpu_torchrun.py``): ``torch.cuda.set_device(LOCAL_RANK)``,
``init_process_group("nccl")`` (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
launcher), the model in ``DistributedDataParallel`` with ``device_ids``, a ``DistributedSampler``,
a few epochs. Under torchrun, and unchanged under hpcdist on the machine's GPUs:

    torchrun --nproc-per-node=1 examples/ddp_gpu.py --epochs 3
    hpcdist submit --site local --set resources.gpus_per_node=1 --wait -- examples/ddp_gpu.py --epochs 3

Each rank says which GPU it trained on and how much CUDA memory it used; rank 0 prints the mean
loss of every epoch (``make gpu-check`` reads these lines). A small regression model on made-up
data: seconds on one GPU. Without a GPU it stops at once, saying so.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def dataset(n: int = 8192, features: int = 32, seed: int = 0) -> TensorDataset:
    """y = tanh(x . w) plus a little noise: the same data on every rank and every run."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g) / math.sqrt(features)
    y = torch.tanh(3 * x @ w) + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ddp_gpu.py: torch sees no GPU (it is written for GPUs: one per rank, NCCL); "
                 "examples/ddp_plain.py runs on CPUs")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    print(f"rank {rank}/{world}: LOCAL_RANK {local_rank}, device {device} ({torch.cuda.get_device_name(device)}), "
          f"backend {dist.get_backend()}", flush=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    data = dataset()
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, pin_memory=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)  # sum of losses x samples, samples
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(x), torch.tensor(float(len(x)), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.6f}", flush=True)

    where = sorted({str(p.device) for p in model.parameters()})
    print(f"rank {rank}: done, parameters on {','.join(where)}, "
          f"peak CUDA memory {torch.cuda.max_memory_allocated(device)} bytes", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

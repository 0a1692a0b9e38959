"""A hang for `hpcdist stacks`: the last rank sleeps while the others wait for it in an all_reduce
that times out after argv[1] seconds (a script written for torchrun: env:// and plain torch)."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=float(sys.argv[1])))
dist.barrier()
if dist.get_rank() == dist.get_world_size() - 1:
    time.sleep(600)  # the straggler
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()

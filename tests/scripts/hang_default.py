"""A user's unchanged script whose group has torch's default timeout (no ``timeout=``): the last
rank sleeps argv[1] seconds while the others wait for it in an all_reduce."""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == dist.get_world_size() - 1:
    time.sleep(float(sys.argv[1]))  # the straggler
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()

"""A rank that stops joining, under a backend that ends ranks as NCCL's watchdog does (the test sets
HPCDIST_TEST_ABORT_AFTER_S): rank 1 sleeps argv[1] seconds while rank 0 waits for it in an all_reduce."""

import sys
import time

import torch
import torch.distributed as dist

import hpcdist

ctx = hpcdist.init()
dist.barrier()
if ctx.rank == 1:
    time.sleep(float(sys.argv[1]))  # the rank that stops joining
dist.all_reduce(torch.ones(4))
ctx.close()

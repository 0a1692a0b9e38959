"""A torchrun-style test script: prints its marker and torchrun's variables, then joins the group.

`ranks.py MARKER [exit RANK CODE | raise RANK | kill RANK | sleep SECONDS | late RANK SECONDS]`:
rank RANK then exits with CODE, or raises, or (once the group is up, so its peers are left in a
collective) kills itself with SIGKILL; or every rank sleeps SECONDS once the group is up (to be
cancelled meanwhile); or rank RANK works SECONDS longer than the others after the group is gone.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

marker = sys.argv[1]
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
print(f"marker {marker} " + " ".join(f"{k}={os.environ[k]}" for k in keys), flush=True)
rank = int(os.environ["RANK"])
if sys.argv[2:3] == ["exit"] and rank == int(sys.argv[3]):
    sys.exit(int(sys.argv[4]))
if sys.argv[2:3] == ["raise"] and rank == int(sys.argv[3]):
    raise ValueError(f"bad value on rank {rank}")
dist.init_process_group("gloo")
if sys.argv[2:3] == ["kill"] and rank == int(sys.argv[3]):
    time.sleep(1.0)  # the others are in the all_reduce below by now
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2:3] == ["sleep"]:
    print("sleeping", flush=True)
    time.sleep(float(sys.argv[3]))
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"sum {t.item():g}", flush=True)
dist.destroy_process_group()
if sys.argv[2:3] == ["late"] and rank == int(sys.argv[3]):
    time.sleep(float(sys.argv[4]))
    print("late rank done", flush=True)

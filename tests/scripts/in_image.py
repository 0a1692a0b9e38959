"""A user's script on hpcdist's API that says where it runs: one JSON line per rank (its host, its
Python, whether it is inside a Charliecloud or podman container, the variables an image could
override) after an all_reduce over every rank."""

import json
import os
import platform
import sys

import torch
import torch.distributed as dist

import hpcdist

ctx = hpcdist.init()
total = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(total)
print("in_image " + json.dumps({"rank": ctx.rank, "host": platform.node(), "python": sys.executable,
                                "inside": os.environ.get("CH_RUNNING", ""), "sum": total.item(),
                                "runtime": os.environ.get("container", ""),  # podman's, inside
                                "env": {k: os.environ.get(k) for k in ("NCCL_DEBUG", "PYTHONPATH", "PYTHONNOUSERSITE",
                                                                       "HOME")}, "cwd": os.getcwd()}), flush=True)
ctx.close()

"""A user's script on hpcdist's API that says where it runs: one JSON line per rank (its host, its
Python, whether it is inside a Charliecloud container) after an all_reduce over every rank."""

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
                                "inside": os.environ.get("CH_RUNNING", ""), "sum": total.item()}), flush=True)
ctx.close()

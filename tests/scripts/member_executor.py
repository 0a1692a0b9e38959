"""Run as a member of the shared-site test bed (tests/test_shared_site.py): an ``hpcdist.Executor``
job named argv[1] on the ``local-group`` site whose function checkpoints through ``hpcdist.init()``
(resuming what the member's last job of that name saved); prints every rank's return as JSON."""

from __future__ import annotations

import json
import os
import pwd
import sys
from typing import Any

import hpcdist


def step(ctx: hpcdist.Context) -> dict[str, Any]:
    import torch

    latest = ctx.checkpoints.load_latest()
    start = 0 if latest is None else latest[0]
    ctx.checkpoints.save(start + 1, {"w": torch.full((2,), float(start + 1))})
    ctx.checkpoints.wait()
    return {"rank": ctx.rank, "user": pwd.getpwuid(os.geteuid()).pw_name, "resumed": start,
            "checkpoints": str(ctx.checkpoints.directory)}


if __name__ == "__main__":
    ex = hpcdist.Executor(site="local-group", nodes=1, tasks_per_node=2, time_min=5, name=sys.argv[1],
                          set={"site.launcher.args": []})
    job = ex.submit(step)
    print(json.dumps({"job_id": job.job_id, "results": job.results(timeout_s=180)}))

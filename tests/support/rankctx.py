"""One rank's ``hpcdist.Context`` built in the test process, as the bootstrap would build it: a
``python`` spec on the ``local`` site with its storage under a test folder (no launcher, no
rendezvous; a group the test made itself is used as it is)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hpcdist.api import Context
from hpcdist.config import load_site
from hpcdist.config.spec import JobSpec
from hpcdist.runtime.job_rank import JobRank
from hpcdist.runtime.rankinfo import RankInfo


def rank_context(root: Path, *, rank: int = 0, world: int = 1, job_id: str | None = None, name: str = "t",
                 timeout_s: float = 10, keep_last: int | None = 3, io_timeout_s: float | None = None,
                 requeue: Callable[[], str] | None = None, site_sets: Sequence[str] = (),
                 checkpoint_dir: Path | None = None) -> Context:
    """Rank `rank` of `world` of job `job_id` (None: "local"), checkpoints in ``root/ckpt`` (or
    `checkpoint_dir`) and
    results under ``root/results``; `site_sets` override the local site (``preemption.max_requeues=3``)."""
    site = load_site("local", [f"storage.results={root / 'results'}", f"storage.checkpoints={root}",
                               f"storage.logs={root / 'logs'}", f"storage.scratch={root / 'scratch'}", *site_sets])
    spec = JobSpec.model_validate({"name": name, "kind": "python", "timeout_s": timeout_s})
    info = RankInfo("local", rank, world, rank, world, 0, 1, job_id=job_id)
    job = JobRank(spec=spec, site=site, info=info, backend="gloo", device=torch.device("cpu"),
                     timeout_s=timeout_s, hosts=(info.hostname,) * world, log=logging.getLogger("hpcdist"),
                     requeue=requeue)
    return Context(job, checkpoint_dir=checkpoint_dir or root / "ckpt", keep_last=keep_last, io_timeout_s=io_timeout_s)

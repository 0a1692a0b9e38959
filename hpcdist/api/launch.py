"""``init``: this rank's ``Context``, built on a ``python`` job's bootstrap or on the launcher's own.

In a hpcdist job the runtime ``attach``es its ``JobContext`` before the user's code runs and
``detach``es after; ``from_job`` builds on it (a built-in job kind calls it directly). Outside,
``_standalone`` reads the rank facts from the launcher and does hpcdist's rendezvous (finite
timeouts, missing ranks named) unless env:// already made the default group.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from hpcdist.api.context import CURRENT, Context
from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.runtime.requeue import StopKind, classify, requeue_for, restart_count

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.runtime.context import JobContext

_ACTIVE: list[JobContext] = []  # the python job's bootstrap on this rank, when there is one
DEFAULT_TIMEOUT_S = 120.0


def attach(ctx: JobContext) -> None:
    """Make `ctx` (a ``python`` job's bootstrap on this rank) what ``init`` builds on."""
    _ACTIVE[:] = [ctx]


def detach(ok: bool) -> None:
    """End of the python job's code on this rank: close a context it left open (write its
    results) when the code succeeded; after a failure or a requeue only release the claim."""
    if CURRENT:
        if ok:
            CURRENT[0].close()
        else:
            CURRENT[0].release()
            CURRENT.clear()
    _ACTIVE.clear()


def init(*, site: str | None = None, name: str | None = None, timeout_s: float | None = None,
         checkpoint_dir: str | Path | None = None, keep_last: int | None = 3,
         io_timeout_s: float | None = None) -> Context:
    """This rank's Context, made once per process (later calls return the same one).

    `site` (or $HPCDIST_SITE) names the site whose storage and preemption signal to use outside
    an hpcdist job; `name` defaults to the script's name; `checkpoint_dir` overrides the job's
    ``<checkpoints>/<name>``; `keep_last` committed checkpoints are kept (None: all);
    `io_timeout_s` is how long ranks wait for rank 0's checkpoint I/O (default 30 minutes).
    """
    if CURRENT:
        return CURRENT[0]
    if _ACTIVE:
        ctx = from_job(_ACTIVE[0], checkpoint_dir, keep_last, io_timeout_s=io_timeout_s)
    else:
        ctx = _standalone(site, name, timeout_s, checkpoint_dir, keep_last)
        ctx.io_timeout_s = io_timeout_s
    CURRENT.append(ctx)
    return ctx


def from_job(job: JobContext, checkpoint_dir: str | Path | None, keep_last: int | None,
             log: logging.Logger | None = None, io_timeout_s: float | None = None) -> Context:
    """In a hpcdist job: the bootstrap's facts, hosts and requeue; the group made on its store
    unless the job kind made it. `log`: the job's logger (a built-in kind's), else ``hpcdist.user``."""
    import torch.distributed as dist

    from hpcdist.runtime import group

    own = not dist.is_initialized()
    if own:
        group.init_process_group(job.store, job.info, job.backend, job.timeout_s, job.device)
    return Context(
        info=job.info, device=job.device, backend=job.backend, timeout_s=job.timeout_s, name=job.spec.name,
        job_id=job.job_id, checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else job.checkpoint_dir,
        result_path=job.result_path(), keep_last=keep_last, requeue=job.requeue, own_group=own, store=None,
        stop_signals=(job.site.preemption.signal, "TERM"), site_name=job.site.name,
        spec_json=job.spec.model_dump_json(), site_json=job.site.model_dump_json(), kind=job.spec.kind,
        hosts=job.hosts, log=log, restarts=restart_count(os.environ), io_timeout_s=io_timeout_s,
        max_requeues=job.site.preemption.max_requeues,
        classify_stop=partial(_classify, job.spec.time_limit_min(job.site) * 60.0,
                              job.site.preemption.seconds_before_end),
    )


def _classify(limit_s: float, seconds_before_end: float) -> StopKind:
    """A stop now: a time-out if it came within the warning time of the job's time limit."""
    launch = float(os.environ.get(LAUNCH_TIME_VAR, "nan"))
    now = time.time()
    return classify(now, now if launch != launch else launch, limit_s, seconds_before_end)


def _standalone(site_ref: str | None, name: str | None, timeout_s: float | None,
                checkpoint_dir: str | Path | None, keep_last: int | None) -> Context:
    """Outside an hpcdist job: rank facts from the launcher, hpcdist's rendezvous unless env://
    already made the group."""
    import torch
    import torch.distributed as dist

    from hpcdist.config.paths import JobPaths
    from hpcdist.config.site import under
    from hpcdist.runtime import group
    from hpcdist.runtime.device import cuda_index
    from hpcdist.runtime.rankinfo import RankInfo
    env = dict(os.environ)
    info = RankInfo.from_env(env)
    site = _site(site_ref or env.get("HPCDIST_SITE"))
    if site is not None:
        os.umask(site.storage.umask)  # what this script writes to the site's storage gets storage.mode
    timeout = timeout_s or (site.defaults.timeout_s if site else DEFAULT_TIMEOUT_S)
    name = name or Path(sys.argv[0]).stem or "python"
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", cuda_index(info.local_rank, env, torch.cuda.device_count())) if cuda else (
        torch.device("cpu"))
    backend = "nccl" if cuda else "gloo"
    store, own = None, not dist.is_initialized()
    if own:
        if cuda:
            torch.cuda.set_device(device)
        if info.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            rendezvous_dir = JobPaths(site.storage, name).rendezvous if site else None
            store, _, _ = group.rendezvous(info, timeout, env, rendezvous_dir,
                                           site.network.socket_ifname if site else None)
            group.init_process_group(store, info, backend, timeout, device)
    job_id = info.job_id or _launcher_run_id(env) or _new_local_id(info.world_size)
    storage = site.storage if site else None
    ckpt = Path(checkpoint_dir) if checkpoint_dir else under(
        storage.checkpoints if storage else Path("hpcdist-out/checkpoints"), name)
    results = under(storage.results if storage else Path("hpcdist-out/results"), name, f"{job_id}.h5")
    signals = (site.preemption.signal if site else env.get("SUBMITIT_PREEMPTION_SIGNAL", "USR2"), "TERM")
    ctx = Context(info=info, device=device, backend=backend, timeout_s=timeout, name=name, job_id=job_id,
                  checkpoint_dir=ckpt, result_path=results, keep_last=keep_last, requeue=requeue_for(env),
                  own_group=own, store=store, stop_signals=signals, site_name=site.name if site else "",
                  site_json=site.model_dump_json() if site else "{}", restarts=restart_count(env),
                  max_requeues=site.preemption.max_requeues if site else None)
    atexit.register(_release_at_exit, ctx)
    ctx.log.info("hpcdist.init: rank %d/%d on %s via %s, %s on %s; job id %s, results in %s", info.rank,
                 info.world_size, info.hostname, info.launcher, backend, device, job_id, results)
    return ctx


def _launcher_run_id(env: dict[str, str]) -> str:
    """torchrun's run id, unless it is its default "none" (shared by every run without --rdzv-id)."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id in ("", "none") else run_id


def _new_local_id(world_size: int) -> str:
    """A job id for a run no launcher names: ``local-<UTC time>-<pid>-<random>``, rank 0's on every
    rank, so each run of a script has its own result file and a rerun never replaces the last."""
    import torch.distributed as dist

    from hpcdist.store.directory import new_run_id

    box = [f"local-{new_run_id()}"]
    if world_size > 1 and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _release_at_exit(ctx: Context) -> None:
    """A script that never called close(): its claim must not outlive it (no collectives here),
    and a background save in flight ends first (``Context.release``)."""
    if ctx._checkpoints is not None:
        ctx.release()


def _site(ref: str | None) -> Site | None:
    if not ref:
        return None
    from hpcdist.config import load_site

    return load_site(ref)

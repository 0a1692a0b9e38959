"""The function every rank runs: environment -> rank facts -> process group -> job kind.

``run_rank`` is what each task runs (submitit pickles and calls ``hpcdist.runtime.run_rank``, which
imports this module on the node). ``main`` is the same thing for a direct launch
(``srun python -m hpcdist.runtime.entry JOB.yaml --site SITE``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from hpcdist import progress
from hpcdist.config.contract import FAULT_EXIT_VAR, LAUNCH_TIME_VAR
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import BootstrapError, HpcdistError
from hpcdist.jobs.registry import Job, resolve
from hpcdist.runtime import group, requeue, teardown
from hpcdist.runtime.context import JobContext
from hpcdist.runtime.device import cuda_index, visible_entries
from hpcdist.runtime.rankinfo import RankInfo
from hpcdist.runtime.ranklog import rank_logger

log = logging.getLogger("hpcdist")


def choose_backend(spec: JobSpec, info: RankInfo, env: Mapping[str, str]) -> tuple[str, Any]:
    """NCCL when this rank has a GPU of its own, gloo otherwise; launch mistakes are errors."""
    import torch

    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wants_gpu = spec.backend == "nccl" or spec.resources.gpus_per_node > 0
    if wants_gpu and gpus == 0:
        hint = "no GPU is visible"
        if visible:
            hint = f"CUDA_VISIBLE_DEVICES={visible!r} is set but torch sees no usable GPU"
        raise BootstrapError(
            f"job asks for GPUs (gpus_per_node={spec.resources.gpus_per_node}, backend={spec.backend}) "
            f"but on {info.hostname} {hint}; check the CUDA build of torch and the GPU request"
        )
    if spec.backend == "gloo" or (spec.backend == "auto" and not (wants_gpu and gpus)):
        return "gloo", torch.device("cpu")
    if not visible_entries(env) and info.local_world_size > gpus:  # every rank sees every GPU
        raise BootstrapError(
            f"{info.local_world_size} ranks on {info.hostname} but only {gpus} GPUs visible: "
            f"two ranks would share a GPU; set tasks_per_node to the GPUs per node"
        )
    return "nccl", torch.device("cuda", cuda_index(info.local_rank, env, gpus))


def _check_gpu_sharing(ctx: JobContext) -> None:
    import torch
    import torch.distributed as dist

    uuid = str(torch.cuda.get_device_properties(ctx.device).uuid)
    seen: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(seen, (ctx.info.hostname, uuid))
    owners: dict[tuple[str, str], list[int]] = {}
    for r, key in enumerate(seen):
        owners.setdefault(key, []).append(r)
    shared = [ranks for ranks in owners.values() if len(ranks) > 1]
    if shared:
        raise BootstrapError(f"ranks {shared[0]} share one GPU on {seen[shared[0][0]][0]}; bind one GPU per rank")


def bootstrap(job: Job[Any], site: Site, env: Mapping[str, str] | None = None) -> tuple[JobContext, Any]:
    """Form the process group for this rank; returns the context and the store to close with.

    Every launcher fact, timing and switch is read from `env` (``os.environ`` by default).
    """
    env = dict(os.environ if env is None else env)
    spec = job.spec
    t_entry = time.time()
    info = RankInfo.from_env(env)
    rank_logger("hpcdist", info, env)
    # SIGTERM (which submitit's handler ignores) sets the stop flag from now on, so one that comes
    # during the bootstrap is not lost; the site's signal stays submitit's until a Context takes it.
    requeue.watch(("TERM",))
    if env.get(FAULT_EXIT_VAR, "") == str(info.rank):
        log.error("fault injection: rank %d exits before joining", info.rank)
        logging.shutdown()
        os._exit(3)
    timeout = spec.timeout(site)
    timings: dict[str, float] = {}
    launch = float(env.get(LAUNCH_TIME_VAR, "nan"))
    timings["launch_to_entry"] = t_entry - launch

    if "torch" in sys.modules:
        log.warning("torch was imported before the bootstrap: import_torch below is not its cost")
    t = time.perf_counter()
    import torch  # noqa: F401 - timed on purpose: it dominates start-up

    timings["import_torch"] = time.perf_counter() - t
    mpi_comm = None
    if job.uses_mpi:
        t = time.perf_counter()
        mpi_comm = _init_mpi(info)
        timings["mpi_init"] = time.perf_counter() - t
    backend, device = choose_backend(spec, info, env)

    os.environ.update(group.socket_ifname_env(site.network.socket_ifname))
    t = time.perf_counter()
    store, endpoint, hosts_by_rank = group.rendezvous(
        info, timeout, env, job.spec.paths(site).rendezvous, site.network.socket_ifname, mpi_comm)
    info = info.placed(hosts_by_rank)  # the node index from every rank's host (Open MPI names none)
    timings["rendezvous"] = time.perf_counter() - t
    if job.makes_group:
        t = time.perf_counter()
        group.init_process_group(store, info, backend, timeout, device)
        timings["init_process_group"] = time.perf_counter() - t
    timings["launch_to_ready"] = time.time() - launch
    ctx = JobContext(
        spec=spec,
        site=site,
        info=info,
        backend=backend,
        device=device,
        timeout_s=timeout,
        hosts=tuple(hosts_by_rank[r] for r in range(info.world_size)),
        log=log,
        timings=timings,
        mpi_comm=mpi_comm,
        endpoint=endpoint,
        store=store,
    )
    ctx.requeue = requeue.requeue_for(env)  # no rendezvous file to clear: forget_endpoint removed it
    if backend == "nccl" and job.makes_group:
        _check_gpu_sharing(ctx)
    log.info(
        "group ready: %s, backend %s, endpoint %s:%d via %s, %.2f s after entry",
        info.describe(), backend, endpoint.addr, endpoint.port, endpoint.via, time.time() - t_entry,
    )
    return ctx, store


def _init_mpi(info: RankInfo) -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BootstrapError(f"this job uses MPI but mpi4py cannot be imported: {exc}") from exc
    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size:
        raise BootstrapError(
            f"MPI sees {comm.Get_size()} rank(s) but the launcher ({info.launcher}) started "
            f"{info.world_size}: MPI was not started by the launcher; with srun add --mpi=pmix "
            f"to launcher.args.srun"
        )
    return comm


def run_rank(spec: JobSpec, site: Site) -> dict[str, Any]:
    """What submitit calls on every rank: the spec's params parsed once here, then ``run_job``."""
    return run_job(resolve(spec, site, check=False), site)


def run_job(job: Job[Any], site: Site) -> dict[str, Any]:
    """Run `job` on this rank; returns this rank's summary (rank 0's names the result file)."""
    spec = job.spec
    os.environ.update({**site.env, **spec.env})
    os.umask(site.storage.umask)  # storage.mode for all this rank writes (a direct launch has the shell's umask)
    ctx, store = bootstrap(job, site)
    # what `hpcdist wait` shows, where the waiter of this very task reads it
    progress.start(ctx.paths.progress, ctx.is_main)
    import torch.distributed as dist  # already imported by the bootstrap, which times it

    try:
        try:
            out = job.kind.load_runner()(ctx, job.params) or {}
        except BaseException:
            _check_out_failed(store, ctx)
            raise
        if not group.finish(store, ctx.info, ctx.timeout_s):
            teardown.leave()  # every gloo worker idle before the interpreter finalizes (SIGABRT otherwise)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"rank": ctx.rank, "host": ctx.info.hostname, "timings": ctx.timings, **out}


def _check_out_failed(store: Any, ctx: JobContext, wait_s: float = 2.0) -> None:
    """A failed rank still checks out, so rank 0 does not wait the full timeout for it.

    Best effort and bounded: when the failure is a lost link to rank 0, the store request would
    block until the store's own timeout and hold back the rank's error, so it runs in a daemon
    thread that this rank stops waiting for after `wait_s`.
    """

    def check_out() -> None:
        try:
            group.check_out(store, ctx.info, failed=True)
        except Exception:  # the store's server (rank 0) may be gone already
            pass

    thread = threading.Thread(target=check_out, name="hpcdist-check-out", daemon=True)
    thread.start()
    thread.join(wait_s)


def main(argv: list[str] | None = None) -> int:
    """Direct launch: every rank loads the spec and site itself."""
    from hpcdist.config import load_site
    from hpcdist.jobs.registry import load_job

    parser = argparse.ArgumentParser(prog="python -m hpcdist.runtime.entry")
    parser.add_argument("job")
    parser.add_argument("--site", default=None)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        site = load_site(args.site, [s[5:] for s in args.sets if s.startswith("site.")])
        job = load_job(args.job, site, [s for s in args.sets if not s.startswith("site.")])
        out = run_job(job, site)
    except HpcdistError as exc:
        print(f"hpcdist: error: {exc}", file=sys.stderr)
        return 1
    if out.get("rank") == 0:
        print({k: v for k, v in out.items() if k != "timings"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

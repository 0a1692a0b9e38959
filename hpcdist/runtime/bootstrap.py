"""The one bootstrap: launcher environment -> rank facts -> device -> rendezvous -> process group
-> ``JobRank``.

Every rank runs it: a job's (``hpcdist.runtime.entry``, for the built-in kinds and the ``python``
kind) and ``hpcdist.init()`` outside any job (``hpcdist.api.launch``, with ``standalone``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from hpcdist.config.contract import FAULT_EXIT_VAR, LAUNCH_TIME_VAR
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import BootstrapError
from hpcdist.runtime import abort, caches, group, requeue, stacks
from hpcdist.runtime.device import cuda_index, visible_entries
from hpcdist.runtime.job_rank import JobRank
from hpcdist.runtime.rankinfo import RankInfo
from hpcdist.runtime.ranklog import rank_logger

log = logging.getLogger("hpcdist")


def choose_backend(spec: JobSpec, info: RankInfo, env: Mapping[str, str]) -> tuple[str, Any]:
    """NCCL when this rank has a GPU of its own, gloo otherwise; launch mistakes are errors.

    Under ``backend: auto`` a rank has a GPU of its own when the scheduler bound GPUs to its task
    (``CUDA_VISIBLE_DEVICES`` set) or the node's GPUs are at least its ranks: a spec that asks for
    no GPUs, run inside an allocation that has them (the preflight, run by ``srun`` in a training
    job), then measures NCCL on the GPUs rather than gloo on CPU tensors.
    """
    import torch

    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wants_gpu = spec.backend == "nccl" or spec.resources.gpus_per_node > 0
    if spec.backend == "auto" and gpus and (visible_entries(env) or info.local_world_size <= gpus):
        wants_gpu = True
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


def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs this rank sees, in CUDA's order, as ``nvidia-smi -L`` names them
    (``GPU-f60acc4e-...``): what tells two ranks' GPUs apart whatever each task's numbering."""
    import torch

    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())]


def adopt_device(device: Any) -> Any:
    """Make `device` this rank's current CUDA device before any collective runs, also under a group
    the script made itself (``hpcdist.init()`` after its own ``init_process_group``): otherwise
    every rank's exchanges of plain data run on ``cuda:0``. A group bound to a device keeps that one."""
    import torch
    import torch.distributed as dist

    if device.type != "cuda":
        return device
    if dist.is_initialized():
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        if bound is not None and bound != device:
            log.warning("the script's group is bound to %s, not %s (hpcdist's choice): using %s", bound, device,
                        bound)
            device = bound
    torch.cuda.set_device(device)
    return device


def bootstrap(spec: JobSpec, site: Site, env: Mapping[str, str] | None = None, *, uses_mpi: bool = False,
              makes_group: bool = True, standalone: bool = False, shared_scratch: bool = True) -> JobRank:
    """Form the process group for this rank and return its context (whose ``store`` the caller
    finishes with ``group.finish``).

    Every launcher fact, timing and switch is read from `env` (``os.environ`` by default).
    `makes_group`: the default group is made here (a kind that makes its own says False).
    `standalone`: ``hpcdist.init()`` outside any hpcdist job: a group env:// already made is
    used as it is (no rendezvous), and one rank alone needs no store server. `shared_scratch`:
    rank 0 may publish its store's endpoint in the site's scratch (False where no site was named:
    the launcher's facts or the node list say where rank 0 is).
    """
    env = dict(os.environ if env is None else env)
    t_entry = time.time()
    info = RankInfo.from_env(env)
    rank_logger("hpcdist", info, env)
    # torch's caches in this user's own scratch, before torch is imported (the script's own process: no TMPDIR)
    (caches.use_private if standalone else caches.for_rank)(spec.paths(site))
    launch = float(env.get(LAUNCH_TIME_VAR, "nan"))
    if not standalone:  # `hpcdist stacks` and a timeout's summary: answered from now on, the rendezvous included
        paths = spec.paths(site, info.job_id or "local")
        stacks.start(paths, info.rank, info.world_size, info.hostname, launch)
        abort.prepare(paths, info.rank, launch)
    # SIGTERM (which submitit's handler ignores) sets the stop flag from now on, so one that comes
    # during the bootstrap is not lost; the site's signal stays submitit's until a Context takes it.
    requeue.watch(("TERM",))
    if env.get(FAULT_EXIT_VAR, "") == str(info.rank):
        log.error("fault injection: rank %d exits before joining", info.rank)
        logging.shutdown()
        os._exit(3)
    timeout = spec.timeout(site)
    timings: dict[str, float] = {}
    timings["launch_to_entry"] = t_entry - launch

    if "torch" in sys.modules and not standalone:
        log.warning("torch was imported before the bootstrap: import_torch below is not its cost")
    t = time.perf_counter()
    import torch  # noqa: F401 - timed on purpose: it dominates start-up
    import torch.distributed as dist

    timings["import_torch"] = time.perf_counter() - t
    mpi_comm = None
    if uses_mpi:
        t = time.perf_counter()
        mpi_comm = _init_mpi(info)
        timings["mpi_init"] = time.perf_counter() - t
    backend, device = choose_backend(spec, info, env)

    os.environ.update(group.socket_ifname_env(site.network.socket_ifname))
    t = time.perf_counter()
    store: Any = None
    endpoint: group.Endpoint | None = None
    if standalone and dist.is_initialized():  # the script's launcher made the group (env://)
        if backend == "nccl":
            device = adopt_device(device)  # before the exchange of host names below
        from hpcdist.runtime.plain import all_gather_plain

        hosts_by_rank = dict(enumerate(all_gather_plain(info.hostname, what="its host name")))
    elif standalone and info.world_size == 1:
        store, hosts_by_rank = dist.HashStore(), {0: info.hostname}
    else:
        gpus = visible_gpus() if backend == "nccl" else []
        store, endpoint, hosts_by_rank, seat = group.rendezvous(
            info, timeout, env, spec.paths(site).rendezvous if shared_scratch else None, site.network.socket_ifname,
            mpi_comm, gpus=gpus, prefer=device.index or 0)
        if seat is not None:  # rank 0's placement: one GPU per rank, also where tasks see subsets
            device = torch.device("cuda", seat)
    if backend == "nccl":
        device = adopt_device(device)
    info = info.placed(hosts_by_rank)  # the node index from every rank's host (Open MPI names none)
    timings["rendezvous"] = time.perf_counter() - t
    if makes_group and not dist.is_initialized():
        t = time.perf_counter()
        group.init_process_group(store, info, backend, timeout, device)
        timings["init_process_group"] = time.perf_counter() - t
    timings["launch_to_ready"] = time.time() - launch
    ctx = JobRank(
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
        standalone=standalone,
    )
    if not standalone:  # a collective NCCL's watchdog times out still ends with hpcdist's summary
        abort.start(ctx, env)
    # no rendezvous file to clear: forget_endpoint removed it
    ctx.requeue = requeue.requeue_for(env, spec.paths(site, info.job_id).requeues if info.job_id else None)
    where = f"endpoint {endpoint.addr}:{endpoint.port} via {endpoint.via}" if endpoint else "no store server"
    log.info("group ready: %s, backend %s, %s, %.2f s after entry", info.describe(), backend, where,
             time.time() - t_entry)
    return ctx


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

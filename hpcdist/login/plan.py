"""Plan, then act (TorchX's ``schedule(submit_dryrun(...))``): a job spec resolved against its
site once, into the one frozen ``Plan`` that every later reader reads.

``make`` (``resolve``, which without ``live`` reads nothing from disk) decides every value of one
submission here and nowhere else: the partition, the time limit, CPUs and GPUs per task, memory,
the ranks' variables, the storage paths and log patterns, the container with its binds, the
launcher's line, the nodes the site's health record excludes, the ``#SBATCH`` options and
submitit's executor parameters (both read from the one table, ``hpcdist.config.sbatch``).
``hpcdist.login.render`` only formats a plan into text (what ``render`` prints and ``submit``
submits), ``hpcdist.login.submit.schedule`` hands it to submitit's executor and to the local
controller, and ``hpcdist.login.site_check`` holds it against the live cluster; none asks the
site again. A chain is a list of plans whose links wait for the one before when they are
scheduled. Pure but
for reading the site's node health record (``hpcdist.login.exclusions``) and checking the
container's image and mounts on disk (``hpcdist.config.container.placed``). The decisions
themselves stay with their owners, asked once each: the CPUs per rank, the ranks' variables and
the container with the job spec (``hpcdist.config.spec``), the paths with ``JobPaths``, the
launch line with the launcher, the order and spelling of the options with the table.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config import sbatch
from hpcdist.config.paths import log_patterns
from hpcdist.errors import SubmitError
from hpcdist.launchers import LaunchPlan, get_launcher
from hpcdist.login.exclusions import Exclusions, for_job

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec
    from hpcdist.containers import ContainerPlan


@dataclass(frozen=True)
class Origin:
    """How the user asked for this job, for the header's reproduce line."""

    job_path: str
    site_ref: str
    overrides: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()  # `hpcdist submit ... -- SCRIPT ARG...`: the user's command
    after: tuple[str, ...] = ()  # job ids this job waits for (afterok): --after, or a chain's previous link
    sweeps: tuple[str, ...] = ()  # `--sweep KEY=V1,V2`: the job is an array, one task per combination
    max_parallel: int | None = None  # the array's %N
    tasks: int | None = None  # an array of this many tasks without sweeps (hpcdist.Executor.map_array)
    part: tuple[int, int] | None = None  # (first task, tasks) of an array split to fit (hpcdist.login.arrays)

    def command(self, verb: str = "submit") -> str:
        parts = ["hpcdist", verb, *([self.job_path] if not self.argv else []), "--site", self.site_ref]
        for item in self.overrides:
            parts += ["--set", item]
        for job_id in self.after:
            parts += ["--after", job_id]
        for item in self.sweeps:
            parts += ["--sweep", item]
        if self.max_parallel is not None and self.sweeps:
            parts += ["--max-parallel", str(self.max_parallel)]
        return shlex.join(parts + (["--", *self.argv] if self.argv else []))

    @property
    def array_size(self) -> int | None:
        """How many tasks the job array has (None: not an array)."""
        if self.part is not None:
            return self.part[1]
        if not self.sweeps:  # the sweep module loads only for a sweep (every plan asks this)
            return self.tasks
        from hpcdist.config.sweep import tasks

        return len(tasks(self.sweeps)) or self.tasks


@dataclass(frozen=True)
class Plan:
    """One submission, every value decided: the spec and site it came from, and what was made of
    them. Its tasks are several in a job array (one spec each), all run by the one script."""

    base: JobSpec  # the spec the script is made from (an array's tasks share it)
    tasks: tuple[JobSpec, ...]
    site: Site
    origin: Origin
    partition: str
    time_min: float  # the time limit, minutes (a fraction is allowed)
    cpus_per_task: int
    gpus_per_node: int
    env: Mapping[str, str]  # what every rank is given: the site's env, the job's, OMP_NUM_THREADS
    job_env: Mapping[str, str]  # what the script exports: `env` with submitit's and the container's
    folder: Path  # submitit's folder (``%j`` for the job id): named after the base spec
    stdout: str  # the per-task log patterns (``%t`` the task), stderr folded into stdout if asked
    stderr: str
    limit_s: int  # the time limit in whole seconds, as the local controller keeps it
    signal_delay_s: int  # how long before the time limit the preemption signal comes
    launch: LaunchPlan  # what the launcher's line is made of
    launch_line: str  # the launcher's line(s) that start one process per rank
    prelude: tuple[str, ...]  # the launcher's lines before it
    container: ContainerPlan | None  # the container each rank runs in, its binds placed on the image
    container_prelude: tuple[str, ...]
    directives: tuple[tuple[str, Any], ...]  # the #SBATCH options in order (a Slurm site's)
    executor_parameters: Mapping[str, Any]  # what submitit's executor is given (``update_parameters``)
    gpu_note: str  # a job that asks no GPUs on a node that has them: why its ranks get none
    excluded: Exclusions = field(default_factory=Exclusions)  # the site's health record's say

    @property
    def slurm(self) -> bool:
        return self.site.scheduler == "slurm"

    @property
    def array(self) -> bool:
        return self.origin.array_size is not None


def make(base: JobSpec, site: Site, origin: Origin, tasks: Sequence[JobSpec] = ()) -> Plan:
    """The plan of `base` on `site` (its `tasks`, one per array task; by default `base` alone),
    kept off the nodes the site's health record marks bad, its container checked on disk."""
    tasks = tuple(tasks) or (base,)
    if not site.scheduler == "slurm" and origin.after:
        raise SubmitError(f"site {site.name!r} has no scheduler to make a job wait for job {origin.after[0]}; "
                          f"submit the jobs in one `hpcdist submit A.yaml B.yaml --chain`, which runs them in order")
    if (origin.array_size or 1) != len(tasks) or (site.scheduler != "slurm" and len(tasks) > 1):
        raise SubmitError(f"{origin.job_path}: {len(tasks)} tasks for an array of {origin.array_size or 1} on site "
                          f"{site.name!r}; a local site runs a sweep's tasks one at a time")
    return resolve(base, site, origin, tasks, live=True)


def resolve(base: JobSpec, site: Site, origin: Origin, tasks: Sequence[JobSpec] = (),
            excluded: Exclusions | None = None, live: bool = False) -> Plan:
    """`base` on `site`, every value decided once. `live`: the site's node health record is read
    (the one read for this plan, ``hpcdist.login.exclusions``) and the container checked on disk,
    its binds placed on the image (``config.container.placed``); else no I/O, `excluded` given."""
    from hpcdist.config.container import placed
    from hpcdist.config.spec import container_for, plan_with

    res, slurm = base.resources, site.scheduler == "slurm"
    partition, part = site.partition(res.partition)
    if live:
        excluded = for_job(base, site, partition, part)
    excluded = excluded or Exclusions()
    minutes, cpus = base.time_limit_min(site), base.cpus_per_task(site, part)
    env, paths, own = base.rank_env(site, cpus), base.paths(site), container_for(base, site)
    container = plan_with(base, site, env, own) if slurm else None
    note = unasked_gpus(base, site, partition)
    array = slurm and origin.array_size is not None
    out, err = log_patterns(paths.folder, array)
    err = out if base.stderr_to_stdout else err
    if container is not None and live:
        container = placed(container, (*site.containers[container.runtime].mounts, *(own.mounts if own else ())))
    job_env, box, container_prelude = dict(env), dict[str, Any](), tuple[str, ...]()
    if container is not None:
        from hpcdist.containers import CONTAINER_VAR, SUBMITTED_WITH_VAR, get_runtime, versions

        runtime = get_runtime(container.runtime)
        box = {"container": tuple(runtime.wrap(container)), "srun_container": tuple(runtime.srun_flags(container)),
               "rank_python": container.python}
        container_prelude = tuple(runtime.prelude(container))
        job_env |= {CONTAINER_VAR: container.runtime,
                    SUBMITTED_WITH_VAR: " ".join(f"{k}={v}" for k, v in versions().items())}
    limit_s = max(1, round(60 * minutes))
    delay_s = site.preemption.warning_s(60 * minutes if slurm else limit_s)
    launcher = get_launcher(site.launcher.kind)
    launch = LaunchPlan(python=site.python or sys.executable, folder=paths.folder, tasks_per_node=res.tasks_per_node,
                        stdout=out, stderr=err, args=site.launcher.line_args, cpus_per_task=cpus,
                        socket_ifname=site.network.socket_ifname, signal=site.preemption.signal, **box)
    directives: tuple[tuple[str, Any], ...] = ()
    if slurm:
        job_env["SUBMITIT_PREEMPTION_SIGNAL"] = site.preemption.signal
        values: dict[str, Any] = {"job-name": base.name, "partition": partition, "nodes": res.nodes + res.spare_nodes,
                                  "ntasks-per-node": res.tasks_per_node, "cpus-per-task": cpus}
        if res.gpus_per_node:
            typed = f"{part.gpu_type}:{res.gpus_per_node}" if part.gpu_type else str(res.gpus_per_node)
            values |= {"gres": f"gpu:{typed}"} if site.gpu_request == "gres" else {"gpus-per-node": typed}
        if res.mem_gb is not None:
            values["mem"] = f"{int(res.mem_gb * 1024)}M"
        size = origin.array_size
        values |= {"time": sbatch.slurm_time(minutes), "account": site.account or None, "qos": site.qos or None,
                   "output": out.replace("%t", "0"), "error": err.replace("%t", "0"), "open-mode": "append",
                   "signal": launcher.signal_flag(site.preemption.signal, delay_s),
                   # spares: a batch node's death ends the job for its standby (hpcdist.runtime.standby)
                   "requeue": None if res.spare_nodes else True, "no-requeue": True if res.spare_nodes else None,
                   "no-kill": True if res.spare_nodes else None,
                   "array": None if size is None else f"0-{size - 1}" + (f"%{origin.max_parallel}"
                                                                          if origin.max_parallel else "")}
        merged = excluded.flag()  # the site's health record's nodes added to the job's own exclude
        extra = {**site.sbatch, **base.sbatch, **({"exclude": merged} if merged else {})}
        directives = sbatch.directives(values, extra, origin.after, base.env_passthrough)
    shape = {"nodes": res.nodes if slurm else 1, "ntasks-per-node": res.tasks_per_node, "time": minutes}
    return Plan(
        base=base, tasks=tuple(tasks) or (base,), site=site, origin=origin, partition=partition, time_min=minutes,
        cpus_per_task=cpus, gpus_per_node=res.gpus_per_node, env=env, job_env=job_env, folder=paths.folder,
        stdout=out, stderr=err, limit_s=limit_s, signal_delay_s=delay_s, launch=launch,
        launch_line=in_job_line(launch, launcher.command(launch), not array) if res.spare_nodes and slurm
        else launcher.command(launch),
        prelude=tuple(launcher.prelude(launch)) if slurm else (),
        container=container, container_prelude=container_prelude, directives=directives,
        executor_parameters=sbatch.executor_parameters(shape, slurm), gpu_note=note, excluded=excluded,
    )


IN_JOB = "hpcdist.runtime.in_job"  # the batch step's supervisor of a job with spare nodes
STANDBY = "hpcdist.runtime.standby"  # its standby job, queued behind it for its batch node's death


def in_job_line(launch: LaunchPlan, line: str, standby: bool = True) -> str:
    """The launcher's srun `line` run by the in-job supervisor, which gives each of its steps
    the nodes (the live ones and the spares) and the task count; before it (not in an array), the
    standby step: a run queues the job's standby if it has none, and a standby (the script's
    argument names the job it stands by for) takes over or ends here, before any rank
    (``hpcdist.runtime.standby``: its exit 3 ends the run; a failure of its own ends only a standby)."""
    folder = shlex.quote(str(launch.folder))
    supervised = f"{launch.host()} -m {IN_JOB} {folder} -- {line}"
    if not standby:
        return supervised
    return (f'{launch.host()} -m {STANDBY} {folder} "$@"; hpcdist_standby=$?\n'
            f'if [ "$hpcdist_standby" -eq 3 ]; then exit 0; fi\n'
            f'if [ "$hpcdist_standby" -ne 0 ] && [ -n "${{1:-}}" ]; then exit "$hpcdist_standby"; fi\n'
            f"{supervised}")


# What a rank says when CUDA finds no GPU: torch's lazy init with CUDA_VISIBLE_DEVICES empty, no
# driver, the runtime's cudaErrorNoDevice, NCCL's process group, and torch.load onto a GPU.
_NO_GPU = re.compile(r"No CUDA GPUs are available|Found no NVIDIA driver|no CUDA-capable device is detected|"
                     r"only supported with GPUs, no GPUs found|torch\.cuda\.is_available\(\) is False")


def unasked_gpus(spec: JobSpec, site: Site, partition: str | None = None) -> str:
    """One line when `spec` asks no GPUs on a node of `site` that has them (``gpus_unasked``); ""
    on a partition where only some nodes have GPUs (``gpu_nodes``): a job asking none is a CPU job
    there, not one that forgot its GPUs."""
    from hpcdist.config.spec import gpus_unasked

    name, part = site.partition(partition or spec.resources.partition)
    return "" if part.nodes_with_gpus < part.nodes else gpus_unasked(spec, site, name, part)


def no_gpu_note(errors: Sequence[str], spec: JobSpec, site: Site) -> str:
    """For the summary of a job whose rank failed on CUDA finding no GPU (`errors`: the failed
    ranks' errors and tracebacks): why, where the job asked none on a node that has some; else ""."""
    note = unasked_gpus(spec, site)
    return f"CUDA found no GPU in the ranks: {note}" if note and any(_NO_GPU.search(e) for e in errors) else ""


__all__: Sequence[str] = ("Origin", "Plan", "make", "resolve")

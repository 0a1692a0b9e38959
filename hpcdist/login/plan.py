"""Plan, then act (TorchX's ``schedule(submit_dryrun(...))``): a job spec resolved against its
site once, into the one frozen ``Plan`` that every later reader reads.

``make`` (``resolve`` without the disk) decides every value of one submission here and nowhere
else: the partition, the time limit, CPUs and GPUs per task, memory, the ranks' variables, the
storage paths and log patterns, the container with its binds, the launcher's line, the nodes
the site's health record excludes, the ``#SBATCH`` options and submitit's executor parameters
(both read from the one table, ``hpcdist.config.sbatch.PARAMETERS``). ``hpcdist.login.render``
only formats a plan into text (what ``render`` prints and ``submit`` submits),
``hpcdist.login.submit.schedule`` hands it to submitit's executor and to the local controller,
and ``hpcdist.login.site_check`` holds it against the live cluster; none asks the site again. A
chain is a list of plans whose links wait for the one before when they are scheduled. Pure but
for reading the site's node health record (``hpcdist.login.exclusions``) and checking the
container's image and mounts on disk (``placed``).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.paths import log_patterns
from hpcdist.config.sbatch import PARAMETERS, executor_parameters, slurm_time
from hpcdist.errors import SubmitError
from hpcdist.launchers import LaunchPlan, get_launcher
from hpcdist.login.exclusions import Exclusions, for_job

if TYPE_CHECKING:
    from hpcdist.config.site import Partition, Site
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
    excluded = for_job(base, site)  # the one read of the site's health record for this plan
    return resolve(base, site, origin, tasks, excluded, on_disk=True)


def resolve(base: JobSpec, site: Site, origin: Origin, tasks: Sequence[JobSpec] = (),
            excluded: Exclusions | None = None, on_disk: bool = False) -> Plan:
    """`base` on `site`, every value decided once, without I/O (`on_disk`: the container is
    checked on disk and its binds placed on the image, ``placed``)."""
    from hpcdist.config.spec import plan_for

    res, slurm = base.resources, site.scheduler == "slurm"
    excluded = excluded or Exclusions()
    partition, part = site.partition(res.partition)
    minutes, cpus = base.time_limit_min(site), base.cpus_per_task(site, part)
    env = base.rank_env(site, cpus)
    limit_s = max(1, round(60 * minutes))
    delay_s = site.preemption.warning_s(60 * minutes if slurm else limit_s)
    folder = base.paths(site).folder
    array = slurm and origin.array_size is not None
    out, err = log_patterns(folder, array)
    err = out if base.stderr_to_stdout else err
    container = plan_for(base, site, env) if slurm else None
    if container is not None and on_disk:
        container = placed(container, base, site)
    job_env = dict(env)
    if slurm:
        job_env["SUBMITIT_PREEMPTION_SIGNAL"] = site.preemption.signal
    if container is not None:
        from hpcdist.containers import CONTAINER_VAR, SUBMITTED_WITH_VAR, versions

        job_env |= {CONTAINER_VAR: container.runtime,
                    SUBMITTED_WITH_VAR: " ".join(f"{k}={v}" for k, v in versions().items())}
    launch = _launch(base, site, folder, (out, err), cpus, container)
    launcher = get_launcher(site.launcher.kind)
    directives = _directives(base, site, partition, part, minutes, cpus, (out, err), delay_s, origin,
                             excluded) if slurm else ()
    shape = {"nodes": res.nodes if slurm else 1, "ntasks-per-node": res.tasks_per_node, "time": minutes}
    return Plan(
        base=base, tasks=tuple(tasks) or (base,), site=site, origin=origin, partition=partition, time_min=minutes,
        cpus_per_task=cpus, gpus_per_node=res.gpus_per_node, env=env, job_env=job_env, folder=folder,
        stdout=out, stderr=err, limit_s=limit_s, signal_delay_s=delay_s, launch=launch,
        launch_line=launcher.command(launch), prelude=tuple(launcher.prelude(launch)) if slurm else (),
        container=container, container_prelude=tuple(_container_prelude(container)), directives=directives,
        executor_parameters=executor_parameters(shape, slurm), gpu_note=_unasked(base, site, partition, part),
        excluded=excluded,
    )


def _launch(spec: JobSpec, site: Site, folder: Path, logs: tuple[str, str], cpus: int,
            container: ContainerPlan | None) -> LaunchPlan:
    """What the site's launcher needs to write its launch line (each rank in `container`, if any)."""
    box: dict[str, Any] = {}
    if container is not None:
        from hpcdist.containers import get_runtime

        runtime = get_runtime(container.runtime)
        box = {"container": tuple(runtime.wrap(container)), "srun_container": tuple(runtime.srun_flags(container)),
               "rank_python": container.python}
    return LaunchPlan(python=site.python or sys.executable, folder=folder, tasks_per_node=spec.resources.tasks_per_node,
                      stdout=logs[0], stderr=logs[1], args=site.launcher.line_args, cpus_per_task=cpus,
                      socket_ifname=site.network.socket_ifname, signal=site.preemption.signal, **box)


def _container_prelude(container: ContainerPlan | None) -> list[str]:
    if container is None:
        return []
    from hpcdist.containers import get_runtime

    return get_runtime(container.runtime).prelude(container)


def _directives(spec: JobSpec, site: Site, partition: str, part: Partition, minutes: float, cpus: int,
                logs: tuple[str, str], delay_s: int, origin: Origin, excluded: Exclusions
                ) -> tuple[tuple[str, Any], ...]:
    """The #SBATCH options, in the table's order (``hpcdist.config.sbatch.PARAMETERS``), then site
    extras and the job's own ``sbatch:`` options (the job's win), sorted, with the nodes the
    site's health record keeps the job from added to its ``exclude``."""
    res = spec.resources
    extra = {**site.sbatch, **spec.sbatch}
    merged = excluded.flag()
    if merged:
        extra["exclude"] = merged
    values: dict[str, Any] = {"job-name": spec.name, "partition": partition, "nodes": res.nodes,
                              "ntasks-per-node": res.tasks_per_node, "cpus-per-task": cpus}
    if res.gpus_per_node:
        typed = f"{part.gpu_type}:{res.gpus_per_node}" if part.gpu_type else str(res.gpus_per_node)
        values |= {"gres": f"gpu:{typed}"} if site.gpu_request == "gres" else {"gpus-per-node": typed}
    if res.mem_gb is not None:
        values["mem"] = f"{int(res.mem_gb * 1024)}M"
    values["time"] = slurm_time(minutes)
    if site.account and "account" not in extra:
        values["account"] = site.account
    if site.qos and "qos" not in extra:
        values["qos"] = site.qos
    values |= {"output": logs[0].replace("%t", "0"), "error": logs[1].replace("%t", "0"), "open-mode": "append",
               "signal": get_launcher(site.launcher.kind).signal_flag(site.preemption.signal, delay_s),
               "requeue": True}
    size = origin.array_size
    if size is not None:
        values["array"] = f"0-{size - 1}" + (f"%{origin.max_parallel}" if origin.max_parallel else "")
    if origin.after:
        # afterok on each; a link that failed cancels this job instead of leaving it pending forever
        values["dependency"] = ",".join([*([str(extra.pop("dependency"))] if "dependency" in extra else []),
                                         *(f"afterok:{j}" for j in origin.after)])
        values["kill-on-invalid-dep"] = extra.pop("kill-on-invalid-dep", "yes")
    if spec.env_passthrough:
        values["export"] = _export(str(extra.pop("export", "ALL")), spec.env_passthrough)
    return (*((p.option, values[p.option]) for p in PARAMETERS if p.option in values), *sorted(extra.items()))


def _export(site_value: str, names: tuple[str, ...]) -> str:
    """``--export`` that adds the job's pass-through names (never values) to the site's choice:
    ``ALL`` (Slurm's default) or a list stays as it is plus the names, ``NONE`` becomes the names."""
    listed = [] if site_value.upper() == "NONE" else [site_value]
    return ",".join([*listed, *names])


# What a rank says when CUDA finds no GPU: torch's lazy init with CUDA_VISIBLE_DEVICES empty, no
# driver, the runtime's cudaErrorNoDevice, NCCL's process group, and torch.load onto a GPU.
_NO_GPU = re.compile(r"No CUDA GPUs are available|Found no NVIDIA driver|no CUDA-capable device is detected|"
                     r"only supported with GPUs, no GPUs found|torch\.cuda\.is_available\(\) is False")


def unasked_gpus(spec: JobSpec, site: Site) -> str:
    """One line when `spec` asks no GPUs on a node that has them (the local machine's, counted
    by ``gpus_per_node: auto``, or a partition's as the site lists them): its ranks get none, as
    submitit and Slurm give none to a job that asks none; "" otherwise."""
    return _unasked(spec, site, *site.partition(spec.resources.partition))


def _unasked(spec: JobSpec, site: Site, name: str, part: Partition) -> str:
    res = spec.resources
    gpus, tasks = part.gpus_per_node, res.tasks_per_node
    if res.gpus_per_node or not gpus:
        return ""
    where = f"a machine with {gpus}" if site.scheduler == "local" else f"partition {name}, which has {gpus} a node"
    if tasks > gpus:
        fix = f"add --set resources.gpus_per_node={gpus} --set resources.tasks_per_node={gpus} (a rank per GPU)"
    else:
        fix = f"add --set resources.gpus_per_node={tasks} to give each rank one"
        if tasks < gpus:
            fix += f" (gpus_per_node={gpus} with tasks_per_node={gpus} uses them all)"
    return f"this job asks no GPUs on {where}, so its ranks get none; {fix}"


def no_gpu_note(errors: Sequence[str], spec: JobSpec, site: Site) -> str:
    """For the summary of a job whose rank failed on CUDA finding no GPU (`errors`: the failed
    ranks' errors and tracebacks): why, where the job asked none on a node that has some; else ""."""
    note = unasked_gpus(spec, site)
    return f"CUDA found no GPU in the ranks: {note}" if note and any(_NO_GPU.search(e) for e in errors) else ""


def placed(box: ContainerPlan, spec: JobSpec, site: Site) -> ContainerPlan:
    """The job's container `box` checked on disk before anything is queued: the image is there,
    every mount's source is, and a Charliecloud image directory has a folder for every bind (each
    moved onto the image's empty mount point that holds it, ``config.container.fold_onto_image``),
    and is given its own ``PATH`` and ``LD_LIBRARY_PATH`` (``config.container.with_image_paths``)."""
    from hpcdist.config.container import fold_onto_image, with_image_paths
    from hpcdist.config.spec import container_for
    from hpcdist.containers import Bind, get_runtime

    runtime = get_runtime(box.runtime)
    if (runtime.image_is_path or box.image.startswith(("/", "./"))) and not Path(box.image).exists():
        raise SubmitError(f"container.image {box.image!r} does not exist here; give the path of the image "
                          f"(a {box.runtime} image on shared storage), e.g. --set container.image=/shared/images/NAME")
    own = container_for(spec, site)
    for mount in (*site.containers[box.runtime].mounts, *(own.mounts if own else ())):
        source = Bind.parse(mount).source
        if not Path(source).exists():
            raise SubmitError(f"container mount {mount!r}: {source} does not exist here; "
                              f"make it, or drop it from container.mounts")
    bad = next((p for p in runtime.listed_paths(box, os.getcwd()) if "," in p), None)
    if bad is not None:  # pyxis's and Apptainer's binds are one comma-separated list (hpcdist.containers)
        raise SubmitError(f"{bad!r} has a comma, which {box.runtime} reads as the end of a bind in its list of "
                          f"mounts; {'submit from' if bad == os.getcwd() else 'use'} a path without one")
    folded, missing = fold_onto_image(box)
    if missing:
        made = " ".join(f"{box.image.rstrip('/')}{t}" for t in missing)
        raise SubmitError(f"image {box.image} has no folder to bind {', '.join(missing)} onto (Charliecloud binds "
                          f"only onto a folder the image has); make the mount point(s) once: mkdir -p {made}")
    return with_image_paths(folded)


__all__: Sequence[str] = ("Origin", "Plan", "make", "resolve")

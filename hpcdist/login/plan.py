"""Plan, then act (TorchX's ``schedule(submit_dryrun(...))``): what ``submit`` will do, made
before anything is queued, and what ``render`` prints.

``load`` reads a job in one pass: the site (with its ``--set site.…`` overrides), then the spec
(read once, overrides applied, its kind resolved, checked against the site), and how the user
asked for it (``Origin``). ``make`` turns a job (or a sweep's tasks) into a ``Plan``: the script
exactly as it will be submitted, submitit's executor parameters, and the tasks with their
paths. ``hpcdist.login.submit.schedule`` consumes a plan; a chain is a list of plans whose links are
made to wait for the one before when they are scheduled. Pure but for reading the spec files
and the site's node health record (``hpcdist.login.exclusions``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import ConfigError, SubmitError
from hpcdist.login.exclusions import Exclusions, for_job
from hpcdist.login.render import Origin, render

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec
    from hpcdist.containers import ContainerPlan
    from hpcdist.kinds.registry import Job


@dataclass(frozen=True)
class Plan:
    """One submission: the script and executor parameters, and its tasks (several: an array)."""

    base: JobSpec  # the spec the script is rendered from (an array's tasks share it)
    tasks: tuple[JobSpec, ...]
    site: Site
    origin: Origin
    script: str
    excluded: Exclusions = field(default_factory=Exclusions)  # the site's health record's say

    @property
    def slurm(self) -> bool:
        return self.site.scheduler == "slurm"

    @property
    def array(self) -> bool:
        return self.origin.array_size is not None

    @property
    def folder(self) -> Path:
        """submitit's folder (``%j`` for the job id): named after the base spec."""
        return self.base.paths(self.site).folder

    @property
    def gpu_note(self) -> str:
        """What `render` and `submit` say of a job that asks no GPUs where the node has some."""
        return unasked_gpus(self.base, self.site)

    @property
    def executor_parameters(self) -> dict[str, Any]:
        """What submitit's executor is given (``update_parameters``)."""
        res, minutes = self.base.resources, self.base.time_limit_min(self.site)
        if self.slurm:
            return {"time": minutes, "nodes": res.nodes, "ntasks_per_node": res.tasks_per_node}
        return {"timeout_min": minutes, "nodes": 1, "tasks_per_node": res.tasks_per_node}


def make(base: JobSpec, site: Site, origin: Origin, tasks: Sequence[JobSpec] = ()) -> Plan:
    """The plan of `base` on `site` (its `tasks`, one per array task; by default `base` alone)."""
    tasks = tuple(tasks) or (base,)
    if not site.scheduler == "slurm" and origin.after:
        raise SubmitError(f"site {site.name!r} has no scheduler to make a job wait for job {origin.after[0]}; "
                          f"submit the jobs in one `hpcdist submit A.yaml B.yaml --chain`, which runs them in order")
    if (origin.array_size or 1) != len(tasks) or (site.scheduler != "slurm" and len(tasks) > 1):
        raise SubmitError(f"{origin.job_path}: {len(tasks)} tasks for an array of {origin.array_size or 1} on site "
                          f"{site.name!r}; a local site runs a sweep's tasks one at a time")
    excluded = for_job(base, site)  # the one read of the site's health record for this plan
    return Plan(base, tasks, site, origin, render(base, site, origin, excluded, placed(base, site)), excluded)


# What a rank says when CUDA finds no GPU: torch's lazy init with CUDA_VISIBLE_DEVICES empty, no
# driver, the runtime's cudaErrorNoDevice, NCCL's process group, and torch.load onto a GPU.
_NO_GPU = re.compile(r"No CUDA GPUs are available|Found no NVIDIA driver|no CUDA-capable device is detected|"
                     r"only supported with GPUs, no GPUs found|torch\.cuda\.is_available\(\) is False")


def unasked_gpus(spec: JobSpec, site: Site) -> str:
    """One line when `spec` asks no GPUs on a node that has them (the local machine's, counted
    by ``gpus_per_node: auto``, or a partition's as the site lists them): its ranks get none, as
    submitit and Slurm give none to a job that asks none; "" otherwise."""
    res = spec.resources
    name, part = site.partition(res.partition)
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


def placed(spec: JobSpec, site: Site) -> ContainerPlan | None:
    """The job's container checked on disk before anything is queued: the image is there, every
    mount's source is, and a Charliecloud image directory has a folder for every bind (each moved
    onto the image's empty mount point that holds it, ``config.container.fold_onto_image``), and
    is given its own ``PATH`` and ``LD_LIBRARY_PATH`` (``config.container.with_image_paths``)."""
    from hpcdist.config.container import fold_onto_image, with_image_paths
    from hpcdist.config.spec import container_for, plan_for
    from hpcdist.containers import Bind, get_runtime

    box = plan_for(spec, site)
    if box is None:
        return None
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


# ---------------------------------------------------------------- loading, in one pass


@dataclass(frozen=True)
class Request:
    """What the user asked for on the command line (or through the Python API)."""

    site: str | None
    sets: tuple[str, ...] = ()
    job: str | None = None  # a spec file, or None with `argv`
    argv: tuple[str, ...] = ()  # `-- SCRIPT ARG...`
    after: tuple[str, ...] = ()
    sweeps: tuple[str, ...] = ()
    max_parallel: int | None = None

    @property
    def site_sets(self) -> list[str]:
        """`--set site.KEY=V` goes to the site config, any other `--set KEY=V` to the job spec."""
        return [s.removeprefix("site.") for s in self.sets if s.startswith("site.")]

    @property
    def job_sets(self) -> list[str]:
        return [s for s in self.sets if not s.startswith("site.")]


Warn = Callable[[str], None]


def load(request: Request, path: str | None = None, after: Sequence[str] | None = None,
         made_earlier: Sequence[Path] = (), on_missing: Warn | None = None) -> tuple[Job[Any], Site, Origin]:
    """The site, then the job (its params parsed and checked against the site), and the origin.
    `path`: another spec than ``request.job`` (a chain's link); `after`: the job ids it waits
    for; `made_earlier`: inputs an earlier link writes; `on_missing`: warn of a missing input
    instead of refusing it (``render``)."""
    from hpcdist.config import load_site
    from hpcdist.kinds.registry import load_job

    path = path or request.job
    site = load_site(request.site, request.site_sets)
    if request.argv:
        job = command_job(request.argv, site, request.job_sets)
    else:
        job = load_job(str(path), site, request.job_sets, on_missing=on_missing, made_earlier=made_earlier)
    limit = request.max_parallel
    if limit is not None and (limit < 1 or not request.sweeps):
        raise ConfigError(f"--max-parallel {limit}: give a number of at least 1, with --sweep (it limits an array)")
    origin = Origin(path or "", request.site or site.name, request.sets, request.argv,
                    after=tuple(request.after if after is None else after), sweeps=request.sweeps,
                    max_parallel=limit)
    return job, site, origin


def command_job(argv: Sequence[str], site: Site, job_sets: list[str]) -> Job[Any]:
    """`-- train.py ARG...` (or `-- -m pkg.mod ARG...`) as a ``python`` job spec, no YAML."""
    from hpcdist.config import apply_overrides, validate
    from hpcdist.config.spec import JobSpec
    from hpcdist.kinds.registry import resolve

    if argv[0] == "-m":
        if len(argv) < 2:
            raise ConfigError("-- -m: a module name must follow -m, e.g. -- -m mypkg.train")
        target, args, name = {"module": argv[1]}, list(argv[2:]), argv[1].rsplit(".", 1)[-1]
    else:
        target, args, name = {"script": argv[0]}, list(argv[1:]), Path(argv[0]).stem
    data = apply_overrides({"name": name or "python", "kind": "python", "params": {**target, "args": args}},
                           job_sets, "job")
    return resolve(validate(JobSpec, data, "command line"), site, origin="command line")


def sweep_jobs(request: Request, site: Site, on_missing: Warn | None = None) -> list[Job[Any]]:
    """One job per combination of the --sweep values, each checked and named with its suffix;
    the spec file is read once."""
    from hpcdist.config.sweep import task_name, tasks
    from hpcdist.kinds.registry import load_jobs

    if request.argv or not request.job:
        raise ConfigError("--sweep needs a job spec YAML; sweep a `-- SCRIPT` job by writing its spec")
    combos = tasks(request.sweeps)
    jobs = load_jobs(request.job, site, request.job_sets, [t.overrides for t in combos], on_missing=on_missing)
    return [dataclasses.replace(job, spec=job.spec.model_copy(update={"name": task_name(job.spec.name, task)}))
            for job, task in zip(jobs, combos, strict=True)]


def chain_links(request: Request, paths: Sequence[str]) -> list[tuple[Job[Any], Site, Origin]]:
    """Every link of a chain loaded and checked before the first is submitted; a link may read
    the checkpoints an earlier link writes."""
    links: list[tuple[Job[Any], Site, Origin]] = []
    for path in paths:
        made = [link[0].spec.paths(link[1]).checkpoints for link in links]
        links.append(load(request, path, after=(), made_earlier=made))
    return links

"""The job spec: what to run (a registered job kind and its parameters) and on how much.

A spec is checked on its own (types, ranges, unknown keys) and against the site it will run on
(partition exists, enough nodes and GPUs, one rank per GPU). Its ``params`` stay a dict here:
the job registry parses them with the kind's model (``hpcdist.kinds.registry.resolve``), so this
module knows nothing of job kinds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from hpcdist.config.container import NONE, Container, outermost
from hpcdist.config.contract import LAUNCH_TIME_VAR, RESTART_COUNT_VAR
from hpcdist.config.paths import JobPaths
from hpcdist.config.sbatch import SbatchOptions
from hpcdist.config.site import EnvMap, EnvNames, Frozen, Partition, Site
from hpcdist.config.tracking import Tracking
from hpcdist.containers import CONTAINER_VAR, SUBMITTED_WITH_VAR, Bind, ContainerPlan, get_runtime
from hpcdist.launchers import get_launcher


@dataclass(frozen=True)
class SpecPath:
    """Marks a params field as a path (``Annotated[str, SpecPath()]``), so the spec loader
    (``hpcdist.kinds.registry.load_job``) resolves it in one place for every kind: a relative path
    in a spec file against the file's folder, one from ``--set`` against the current folder.

    `site_root`: a relative value naming an existing entry under this site storage root
    (``checkpoints``) is kept as it is, to be looked up there; so is one that names nothing yet,
    which an earlier job of a chain may write. `required`: the path is an input the job reads;
    one that is not there is a warning at ``render`` and an error at ``submit``.
    """

    site_root: Literal["checkpoints", "results"] | None = None
    required: bool = True
    hint: str = ""  # how to make a missing input, for the message


def _partition_name(value: object) -> object:
    """A partition named with a number (``3090``) as its name: YAML and ``--set`` read it as an
    int. A YAML boolean (``on``, ``yes``: a partition named so) cannot be told back into its word."""
    if isinstance(value, bool):
        raise ValueError(f"{value} is how YAML reads a bare on/off/yes/no/true/false; quote the partition's name "
                         f"(partition: 'on', or --set \"resources.partition='on'\")")
    return str(value) if isinstance(value, int | float) else value


class Resources(Frozen):
    """What the job asks the scheduler for."""

    partition: Annotated[str | None, BeforeValidator(_partition_name)] = None
    nodes: int = Field(default=1, ge=1)
    # The fewest nodes a job may run again on after a node failure, when fewer live nodes than it
    # asked remain (``hpcdist.login.node_failure_wait`` updates the pending job's node count). None: 1 for a
    # job that resumes at another world size, exactly `nodes` for the others.
    min_nodes: int | None = Field(default=None, ge=1)
    # Hot spares: nodes asked beyond `nodes` that run no rank; when a node of the job dies, the
    # job goes on in the same allocation on the live nodes and a spare (``hpcdist.runtime.in_job``)
    spare_nodes: int = Field(default=0, ge=0)
    tasks_per_node: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=0, ge=0)
    cpus_per_task: int | None = Field(
        default=None, ge=1, description="CPUs per rank; None: 1 for a CPU job, a GPU's share of the node's for a "
        "GPU job (JobSpec.cpus_per_task)")
    mem_gb: float | None = Field(default=None, gt=0)
    # minutes; a fraction is allowed (submitit's ``timeout_min``): Slurm gets ``--time=M:SS``
    time_min: int | float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _min_within_nodes(self) -> Resources:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes {self.min_nodes} is more than nodes {self.nodes}; set min_nodes to at most "
                             f"{self.nodes} (how many nodes the job may shrink to when a node fails)")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


THREADS_VAR = "OMP_NUM_THREADS"  # each rank's thread count (torch's intra-op threads), from cpus_per_task


# A job name is a folder under every storage root and Slurm's job name: one plain name.
NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"


class JobSpec(Frozen):
    """One job: a kind from the registry, its parameters, and its resources."""

    name: str = Field(min_length=1, max_length=128)
    kind: str
    resources: Resources = Field(default_factory=Resources)
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float | None = Field(default=None, gt=0)
    env: EnvMap = Field(default_factory=dict)
    env_passthrough: EnvNames = Field(
        default=(), description="variables the job takes from the submitting shell; their values are never written"
    )
    params: dict[str, Any] = Field(default_factory=dict)
    sbatch: SbatchOptions = Field(default_factory=dict, description="extra #SBATCH options for this job")
    on_node_failure: Literal["requeue", "fail"] | None = Field(
        default=None, description="when a node dies: run again without it (requeue) or end (fail); "
        "None: the kind's default (requeue for train_gpt, fail for the others)")
    on_rank_failure: Literal["in_place", "step"] = Field(
        default="step", description="a job with spare nodes, when a rank's process dies or hangs on a live node: "
        "start every rank again in a new process (step, the default), or start that rank again alone while the "
        "others run the job again in their processes (in_place: faster, for code written to run twice in one "
        "process: module globals, threads and CUDA memory stay as the failed run left them)")
    container: Container | None = Field(default=None, description="the image each rank runs in (over the site's)")
    folder: str | None = Field(default=None, description="where the job's pickles and per-rank logs go (submitit's "
                               "folder; %j is the job id); default <storage.logs>/<name>/%j")
    stderr_to_stdout: bool = Field(default=False, description="each rank's stderr into its stdout file")
    tracking: Tracking | None = Field(default=None, description="experiment trackers (mlflow, tensorboard, wandb); "
                                      "over the site's tracking:")

    @field_validator("folder")
    @classmethod
    def _absolute_folder(cls, value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().absolute())

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not re.fullmatch(NAME_PATTERN, value):
            raise ValueError(
                f"the job name becomes a folder under each storage root, so it must match {NAME_PATTERN} "
                f"(letters, digits, '.', '_', '-'; no '/', no leading '.'); rename the job, "
                f"e.g. --set name=my_job"
            )
        return value

    @model_validator(mode="after")
    def _passthrough_not_set_here(self) -> JobSpec:
        both = sorted(set(self.env) & set(self.env_passthrough))
        if both:
            raise ValueError(f"{', '.join(both)} is both in env and in env_passthrough; keep it in one")
        return self

    def timeout(self, site: Site) -> float:
        """Seconds any rendezvous or collective may wait before it fails."""
        return self.timeout_s if self.timeout_s is not None else site.defaults.timeout_s

    def cpus_per_task(self, site: Site, part: Partition | None = None) -> int:
        """CPUs each rank gets on `site`, on partition `part` (the job's when not given; a plan
        passes the one it looked up) (``--cpus-per-task``, and ``OMP_NUM_THREADS`` by default):
        the one place the default is decided.
        ``resources.cpus_per_task`` when given; else 1 for a job without GPUs, and for a GPU job
        its GPUs' share of the node's CPUs less the site's ``reserved_cpus_per_node``
        (``(cpus_per_node - reserved) // gpus_per_node`` of the partition: 14 on an 8-GPU node of
        112 CPUs), so a job on part of a node leaves the other GPUs their CPUs. On the local site
        the node is this machine: no more than its CPUs."""
        res = self.resources
        if res.cpus_per_task is not None:
            return res.cpus_per_task
        if not res.gpus_per_node:
            return 1
        part = part or site.partition(res.partition)[1]
        if site.scheduler == "local":
            from hpcdist.scheduler.local_jobs import machine_cpus

            cpus = min(part.cpus_per_node, machine_cpus())
        else:
            cpus = part.cpus_per_node
        return max(1, (cpus - part.reserved_cpus_per_node) // max(res.tasks_per_node, part.gpus_per_node))

    def rank_env(self, site: Site, cpus: int | None = None) -> dict[str, str]:
        """The variables hpcdist exports to every rank: the site's env, the job's over it, and
        ``OMP_NUM_THREADS`` from the rank's `cpus` (``cpus_per_task`` when not given: a plan passes
        the one it decided) unless one of them sets it or the job takes it from the submitting
        shell (``env_passthrough``)."""
        env = {**site.env, **self.env}
        if THREADS_VAR not in env and THREADS_VAR not in self.env_passthrough:
            env[THREADS_VAR] = str(self.cpus_per_task(site) if cpus is None else cpus)
        return env

    def trackers(self, site: Site) -> Tracking:
        """The trackers this job logs to: its own ``tracking`` over the site's default."""
        return (self.tracking or Tracking()).over(site.tracking)

    def time_limit_min(self, site: Site) -> float:
        return self.resources.time_min or site.defaults.time_min

    def paths(self, site: Site, job_id: str = "%j", folder_name: str = "") -> JobPaths:
        """Every path of this job on `site` (``hpcdist.config.paths``)."""
        return JobPaths(site.storage, self.name, job_id, folder_name, self.folder or "")

    def result_path(self, site: Site, job_id: str, suffix: str = "") -> Path:
        """``<results root>/<job name>/<job id><suffix>.h5``: where the job's result lands."""
        return self.paths(site, job_id).result(suffix)


def fit_to_site(spec: JobSpec, site: Site) -> list[tuple[str, object, str]]:
    """Problems that make `spec` impossible on `site`, as (key path, value, what is allowed)."""
    problems: list[tuple[str, object, str]] = []
    res = spec.resources
    if res.partition is not None and res.partition not in site.partitions:
        problems.append(
            ("resources.partition", res.partition, f"one of {sorted(site.partitions)} on site {site.name!r}")
        )
        return problems
    pname, part = site.partition(res.partition)
    if res.nodes > part.nodes:
        problems.append(("resources.nodes", res.nodes, f"at most {part.nodes} on partition {pname!r}"))
    elif res.nodes + res.spare_nodes > part.nodes:
        problems.append(("resources.spare_nodes", res.spare_nodes, f"at most {part.nodes - res.nodes}: nodes + "
                         f"spare_nodes must fit the {part.nodes} nodes of partition {pname!r}"))
    if res.spare_nodes and (site.scheduler != "slurm" or site.launcher.kind != "srun"):
        problems.append(("resources.spare_nodes", res.spare_nodes, f"0 on site {site.name!r}: spares are Slurm nodes "
                         f"the job's srun steps move to (launcher.kind srun; this site has scheduler "
                         f"{site.scheduler!r}, launcher.kind {site.launcher.kind!r})"))
    if res.gpus_per_node > part.gpus_per_node:
        here = " (the GPUs `nvidia-smi -L` lists on this machine, within CUDA_VISIBLE_DEVICES)" \
            if site.scheduler == "local" else ""
        problems.append(("resources.gpus_per_node", res.gpus_per_node,
                         f"at most {part.gpus_per_node} on partition {pname!r}{here}"))
    elif res.gpus_per_node and res.nodes > part.nodes_with_gpus:
        problems.append(("resources.nodes", res.nodes, f"at most {part.nodes_with_gpus} with GPUs on partition "
                         f"{pname!r} (its other nodes have none)"))
    elif res.gpus_per_node and res.tasks_per_node != res.gpus_per_node:
        problems.append(
            (
                "resources.tasks_per_node",
                res.tasks_per_node,
                f"{res.gpus_per_node} (one rank per GPU, as gpus_per_node={res.gpus_per_node})",
            )
        )
    if part.reserved_cpus_per_node >= part.cpus_per_node:
        problems.append((f"site partitions.{pname}.reserved_cpus_per_node", part.reserved_cpus_per_node,
                         f"fewer than its cpus_per_node {part.cpus_per_node} (the rest are the ranks')"))
    cpus = spec.cpus_per_task(site, part)
    if res.tasks_per_node * cpus > part.cpus_per_node and site.scheduler == "slurm":
        key, value = ("cpus_per_task", cpus) if res.cpus_per_task else ("tasks_per_node", res.tasks_per_node)
        problems.append((f"resources.{key}", value,
                         f"tasks_per_node x cpus_per_task <= {part.cpus_per_node} CPUs on partition {pname!r}"))
    if part.mem_gb is not None and res.mem_gb is not None and res.mem_gb > part.mem_gb:
        problems.append(("resources.mem_gb", res.mem_gb, f"at most {part.mem_gb} on partition {pname!r}"))
    limit = spec.time_limit_min(site)
    if limit > part.max_time_min:
        problems.append(
            ("resources.time_min", limit, f"at most {part.max_time_min} min on partition {pname!r}")
        )
    if site.qos_max_time_min is not None and limit > site.qos_max_time_min and "qos" not in spec.sbatch:
        problems.append(("resources.time_min", limit, f"at most {site.qos_max_time_min} min under QOS "
                         f"{site.qos!r} (its MaxWall; a job over it waits in the queue for ever)"))
    if spec.backend == "nccl" and res.gpus_per_node == 0:
        problems.append(("backend", "nccl", "gloo or auto when the job asks for no GPUs"))
    return problems + container_problems(spec, site)


def gpus_unasked(spec: JobSpec, site: Site, name: str, part: Partition) -> str:
    """One line when `spec` asks no GPUs on partition `name` (`part`) that has them (the local
    machine's, counted by ``gpus_per_node: auto``, or a partition's as the site lists them): its
    ranks get none, as submitit and Slurm give none to a job that asks none; "" otherwise."""
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


# ---------------------------------------------------------------- the job's container on its site


def container_for(spec: JobSpec, site: Site) -> Container | None:
    """The job's container: the site's default with the job's own keys over it; None to run outside."""
    base = site.container.model_dump(exclude_unset=True) if site.container else {}
    own = spec.container.model_dump(exclude_unset=True) if spec.container else {}
    merged = Container(**{**base, **own})
    if merged.runtime == NONE or (merged.image is None and "runtime" not in own):
        return None  # a site's default runtime waits for a job that names an image
    return merged


def container_problems(spec: JobSpec, site: Site) -> list[tuple[str, object, str]]:
    """What makes the job's container impossible on `site` (key path, value, what is allowed); no I/O."""
    box = container_for(spec, site)
    if box is None:
        return []
    if box.runtime is None:
        have = sorted(site.containers) or "(none: the site has no runtime)"
        return [("container.runtime", box.runtime, f"one of {have} for image {box.image!r}")]
    if site.scheduler != "slurm":
        return [("container", box.runtime, f"a Slurm site: site {site.name!r} starts its ranks in this Python; "
                 f"drop the container or use a Slurm site")]
    if box.runtime not in site.containers:
        have = ", ".join(sorted(site.containers)) or "none"
        return [("container.runtime", box.runtime, f"one of the site's runtimes: {have} (its config lists them "
                 f"under containers:)")]
    if box.image is None:
        return [("container.image", None, "the image to run, e.g. --set container.image=/shared/images/pytorch")]
    if get_runtime(box.runtime).srun_only and site.launcher.kind not in ("srun", "torchrun"):
        return [("container.runtime", box.runtime, f"a launcher that starts its ranks with srun ({box.runtime} is an "
                 f"srun plugin), not launcher.kind {site.launcher.kind!r}")]
    if uses_pmix(site) and site.containers[box.runtime].pmix_dir is None:
        # enroot gives a container its own /tmp and binds PMIx's folder only through its optional
        # 50-slurm-pmi.sh hook; Apptainer and podman bind nothing of it: a rank could not reach its server
        return [(f"site containers.{box.runtime}.pmix_dir", None, "Slurm's PMIx folder (mpi.conf PMIxCliTmpDirBase, "
                 "else slurm.conf TmpFS, e.g. /tmp), bound in the container: the launcher runs srun --mpi=pmix")]
    return []


def uses_pmix(site: Site) -> bool:
    """Whether the site's srun starts its ranks with Slurm's PMIx plugin (``--mpi=pmix``, ``pmix_v4``)."""
    args = site.launcher.line_args if site.launcher.kind == "srun" else ()
    return any(a.startswith("--mpi=pmix") or (a == "--mpi" and b.startswith("pmix"))
               for a, b in zip(args, (*args[1:], ""), strict=False))


# What the ranks read that an image's own values must not replace: hpcdist's and submitit's
# job-wide variables (the job script exports them), and Slurm's that a rank's bootstrap reads
# besides its launcher's table (requeues, arrays).
_JOB_WIDE = (CONTAINER_VAR, SUBMITTED_WITH_VAR, LAUNCH_TIME_VAR, "SUBMITIT_EXECUTOR", "SUBMITIT_PREEMPTION_SIGNAL")
_SLURM_READ = (RESTART_COUNT_VAR, "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_SUBMIT_DIR")


def _task_names(site: Site) -> tuple[str, ...]:
    """Every variable the site launcher's environment tables read (``hpcdist.launchers``)."""
    tables = get_launcher(site.launcher.kind).env_tables
    names = {n for t in tables for n in (*t.detect, *(v for vs in t.fields.values() for v in vs))}
    return tuple(sorted(names | set(_SLURM_READ)))


def plan_for(spec: JobSpec, site: Site) -> ContainerPlan | None:
    """The container a launch line wraps each rank in (``plan_with`` the ranks' variables)."""
    return plan_with(spec, site, spec.rank_env(site), container_for(spec, site))


def plan_with(spec: JobSpec, site: Site, env: Mapping[str, str], box: Container | None) -> ContainerPlan | None:
    """The container `box` (``container_for``) a launch line wraps each rank in, binds as written
    (no I/O): the storage roots, the site's mounts for the runtime, the job's; a bind under
    another is dropped. `env`: the ranks' variables (``JobSpec.rank_env``)."""
    if box is None or box.runtime is None or box.image is None or box.runtime not in site.containers:
        return None
    runtime = site.containers[box.runtime]
    roots = [str(r) for r in site.storage.roots]
    pmix = [runtime.pmix_dir] if runtime.pmix_dir else []
    binds = [Bind(r, r) for r in roots] + [Bind.parse(m) for m in (*pmix, *runtime.mounts, *box.mounts)]
    # Charliecloud's ranks keep the host's $HOME (ch-run binds nothing over it); the others get a
    # writable one under the job's scratch, bound with the scratch root
    home = None if box.runtime == "charliecloud" else str(spec.paths(site).container_home)
    return ContainerPlan(box.runtime, box.image, box.python or "python3", outermost(binds), runtime.args,
                         gpus=spec.resources.gpus_per_node > 0,
                         names=tuple(sorted({*env, *spec.env_passthrough, *_JOB_WIDE})),
                         task_names=_task_names(site), home=home,
                         pythonpath="PYTHONPATH" in env or "PYTHONPATH" in spec.env_passthrough,
                         usersite="PYTHONNOUSERSITE" in env or "PYTHONNOUSERSITE" in spec.env_passthrough,
                         pmix_dir=runtime.pmix_dir, infiniband=bool(site.network.ib_hcas))


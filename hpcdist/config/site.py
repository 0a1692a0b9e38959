"""The site config: one YAML file per cluster, validated into frozen models, one per section.

A site is described once by whoever knows the cluster (partitions, launcher, network, storage,
baselines) and then used by every job. Unknown keys are errors, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)

from hpcdist.config.base import ExpandedPath, Frozen
from hpcdist.config.container import Container, RuntimeSite, sites_runtimes
from hpcdist.config.env import REDACTED, EnvMap, EnvNames, looks_secret  # noqa: F401 (config.site users name them here)
from hpcdist.config.tracking import Tracking
from hpcdist.errors import ConfigError
from hpcdist.files.user import current_user  # noqa: F401 (its home; config.site users name it here)
from hpcdist.launchers import launcher_names

_FROM_ENV = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*):-(?P<default>\d+)\}")


def _count_from_env(value: object) -> object:
    """A count written as ``${NAME:-DEFAULT}``: the variable's value when set, else DEFAULT (the
    local cluster's node count follows ``HPCDIST_NODES``, as cluster/up.sh does)."""
    if isinstance(value, str) and (m := _FROM_ENV.fullmatch(value.strip())):
        return os.environ.get(m["name"]) or m["default"]
    return value


def _gpus_of_machine(value: object) -> object:
    """``auto`` (the local site's): the GPUs this machine shows a job started from this shell
    (``hpcdist.scheduler.local_jobs.machine_gpus``), counted when the site is loaded."""
    if value == GPUS_AUTO:
        from hpcdist.scheduler.local_jobs import machine_gpus

        return len(machine_gpus(os.environ))
    return value


GPUS_AUTO = "auto"


class Partition(Frozen):
    """One Slurm partition (or the single 'partition' of the local site)."""

    nodes: Annotated[int, BeforeValidator(_count_from_env)] = Field(
        ge=1, description="nodes in the partition (or ${VAR:-DEFAULT}: from the environment)")
    cpus_per_node: int = Field(ge=1)
    reserved_cpus_per_node: int = Field(default=0, ge=0, description="CPUs per node kept for the system, not ranks")
    mem_gb: float | None = Field(default=None, gt=0)
    gpus_per_node: Annotated[int, BeforeValidator(_gpus_of_machine)] = Field(
        default=0, ge=0, description="GPUs per node; auto (local site only): this machine's, counted at submit")
    gpu_type: str | None = Field(default=None, description="the GRES type (gpu:a100:4): jobs ask for it by name")
    gpu_nodes: int | None = Field(default=None, ge=1, description="how many of its nodes have the GPUs; "
                                  "unset: all of them")
    max_time_min: int = Field(default=60, ge=1)

    @model_validator(mode="after")
    def _gpu_nodes_within(self) -> Partition:
        if self.gpu_nodes is not None and self.gpu_nodes > self.nodes:
            raise ValueError(f"gpu_nodes {self.gpu_nodes} is more than its nodes {self.nodes}")
        return self

    @property
    def nodes_with_gpus(self) -> int:
        return self.nodes if self.gpu_nodes is None else self.gpu_nodes


class Launcher(Frozen):
    """How the job script starts one process per rank: a launcher registered in ``hpcdist.launchers``.

    ``args`` belong to their launcher: ``{srun: [--mpi=pmix], mpirun: [--bind-to, core]}``, and
    only the entry of ``kind`` reaches the launch line, so switching the kind (``--set
    site.launcher.kind=mpirun``) never hands srun's options to mpirun or torchrun. A plain list
    (the older form) is the arguments of the file's own kind (``pin_launcher_args``), or of the
    kind in effect when it comes from ``--set``.
    """

    kind: str = "srun"
    args: dict[str, tuple[str, ...]] = Field(default_factory=dict, description="arguments per launcher kind")

    @model_validator(mode="before")
    @classmethod
    def _plain_list(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("args"), list | tuple):
            return {**data, "args": {data.get("kind", "srun"): data["args"]}}
        return data

    @field_validator("kind")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in launcher_names():
            raise ValueError(f"unknown launcher; registered launchers: {', '.join(launcher_names())}")
        return value

    @field_validator("args")
    @classmethod
    def _known_kinds(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        unknown = sorted(set(value) - set(launcher_names()))
        if unknown:
            raise ValueError(
                f"arguments for unknown launcher(s) {', '.join(unknown)}; give them per launcher kind "
                f"({', '.join(launcher_names())}), e.g. args: {{srun: [--mpi=pmix]}}"
            )
        return value

    @property
    def line_args(self) -> tuple[str, ...]:
        """The arguments of the launcher in use: what its launch line gets."""
        return self.args.get(self.kind, ())


def pin_launcher_args(data: dict[str, object]) -> dict[str, object]:
    """A site file's plain ``launcher.args`` list made the arguments of that file's own kind,
    before ``--set`` overrides apply (so ``--set site.launcher.kind=torchrun`` does not inherit
    srun's ``--mpi=pmix``)."""
    launcher = data.get("launcher")
    if isinstance(launcher, dict) and isinstance(launcher.get("args"), list | tuple):
        kind = launcher.get("kind", "srun")
        return {**data, "launcher": {**launcher, "args": {kind: list(launcher["args"])}}}
    return data


class Baselines(Frozen):
    """Figures this site is expected to reach; benchmarks compare against them."""

    min_busbw_gbps: dict[str, float | dict[str, float]] = Field(
        default_factory=dict,
        description="minimum bus bandwidth per collective (GB/s): one figure, a peak, compared at the largest size "
        "a run measured; or one per message size ({16M: 40, 8G: 280}), each compared at that size when measured",
    )
    min_p2p_gbps: float | None = Field(default=None, ge=0)
    expected_busbw_gbps: dict[str, float] = Field(default_factory=dict)
    expected_p2p_gbps: float | None = Field(default=None, ge=0)
    max_latency_us: float | None = Field(
        default=None, gt=0, description="largest acceptable point-to-point (ping-pong) latency, microseconds"
    )


# The variables by which gloo and NCCL pick their interface: set from ``network.socket_ifname``
# by the rank bootstrap (``hpcdist.runtime.group.socket_ifname_env``), never in a site's env.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Network(Frozen):
    """The interconnect as the site's users know it."""

    ib_hcas: tuple[str, ...] = ()
    link_rate_gbps: float | None = Field(default=None, gt=0, description="per-port link rate, Gb/s")
    socket_ifname: str | None = None
    mpi_cuda_aware: bool = Field(default=False, description="its MPI takes GPU buffers (built with CUDA support)")


def under(root: Path, *parts: str) -> Path:
    """``root/part/...`` where each part is one plain file or folder name: a part that would
    leave `root` (``..``, a ``/``, an absolute path, empty) is a ConfigError, so no job name,
    job id or key can write outside the storage root it was meant for."""
    for part in parts:
        if part in ("", ".", "..") or "/" in part or os.sep in part or "\x00" in part:
            raise ConfigError(
                f"{part!r} cannot name a file or folder under {root}: it must be one plain name "
                f"(no '/', not '.' or '..', not empty); rename the job or key that produced it"
            )
    return root.joinpath(*parts)


StorageRoot = Literal["results", "checkpoints", "scratch", "logs"]


def _octal_mode(value: object) -> object:
    """``"0640"``, ``"640"`` or ``"0o640"`` (YAML's unquoted ``0640`` arrives as the int 416)."""
    if isinstance(value, str):
        try:
            return int(value.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError("not an octal file mode; write it in quotes, e.g. '0640'") from None
    return value


def _file_mode(value: int) -> int:
    if not 0 <= value <= 0o777 or value & 0o600 != 0o600 or value & 0o111:
        raise ValueError(
            f"{value:#o} is not a file mode hpcdist can use: the owner needs read and write (0600), "
            f"no execute bits; e.g. '0640' (group reads) or '0600' (owner only), in quotes"
        )
    if value & 0o022:
        raise ValueError(
            f"{value:04o} lets {'the group' if value & 0o020 else 'everyone'} write the job's files (pickles, code "
            f"snapshots, checkpoints), which hpcdist later runs or unpickles; use '0640' (group reads) or '0600'"
        )
    return value


# A permission mode for files on shared storage, read as octal and shown as '0640'.
FileMode = Annotated[
    int,
    BeforeValidator(_octal_mode),
    AfterValidator(_file_mode),
    PlainSerializer(lambda m: f"{m:04o}", return_type=str),
]


def _others_write(root: Path) -> bool:
    """True when users other than its owner may make entries in `root` (group- or world-writable)."""
    try:
        return bool(os.stat(root).st_mode & 0o022)
    except OSError:  # not made yet: whoever makes it owns it, with ``Storage.folder_mode``
        return False


class Storage(Frozen):
    """Roots on shared storage, visible from the login node and every compute node."""

    results: ExpandedPath
    checkpoints: ExpandedPath
    scratch: ExpandedPath
    logs: ExpandedPath
    mode: FileMode = Field(
        default=0o640, description="files hpcdist and its jobs create; folders add x where r is set (0750)"
    )
    per_user: bool | None = Field(
        default=None,
        description="each user's files in a folder of their own, <root>/<user>; by default where others may "
                    "write the root (a group's root, chmod 3770), and not in a root of one's own",
    )

    def root(self, name: StorageRoot) -> Path:
        """Where this user's files of root `name` go: ``<root>/<user>`` on a root others may write
        (or with ``per_user: true``), the root itself otherwise. Every path of a job starts here
        (``hpcdist.config.paths``); the node-health record alone is the group's, at the root."""
        base: Path = getattr(self, name)
        if self.per_user is False or (self.per_user is None and not _others_write(base)):
            return base
        return base / current_user()
    checksum: Literal["xxh3-128", "sha256"] = Field(
        default="xxh3-128", description="digest of every checkpoint array: xxh3-128 (memory speed, finds torn "
        "writes and flipped bits) or sha256 (cryptographic, ~10x slower); a job's HPCDIST_CHECKSUM overrides it"
    )

    @property
    def folder_mode(self) -> int:
        """`mode`'s folder form (x where r is set: 0750 for 0640): every folder hpcdist makes on
        this storage, a missing root included, whichever command makes it first."""
        return self.mode | (self.mode & 0o444) >> 2

    @property
    def umask(self) -> int:
        """The process umask that gives `mode` to new files and `folder_mode` to new folders:
        set by the submit side (and so, through sbatch, on the job) and by every rank."""
        return 0o777 & ~self.folder_mode

    @property
    def roots(self) -> tuple[Path, ...]:
        """Every root as configured (results, checkpoints, scratch, logs): what a code snapshot
        never copies (``hpcdist.kinds.snapshot``) and a container binds."""
        return tuple(getattr(self, name) for name in get_args(StorageRoot))

    def path(self, root: StorageRoot, *parts: str) -> Path:
        """A path under this user's folder of one root, built from job names, ids and keys through ``under``."""
        return under(self.root(root), *parts)


class Preemption(Frozen):
    """How the scheduler warns a job before killing it, and how often it may come back."""

    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = "USR2"
    seconds_before_end: int = Field(default=120, ge=0)
    max_requeues: int = Field(default=3, ge=0)
    in_job_restarts_per_hour: int = Field(
        default=3, ge=0, description="a job with spare nodes: in-place restarts (a rank killed or hung on a live "
        "node, started again there) it may take in any hour; a rate, so a long job with a fault a day never runs "
        "out; past it the job ends, naming the fault")

    def warning_s(self, limit_s: float) -> int:
        """Seconds before the time limit that the signal comes: ``seconds_before_end``, or half
        the limit where that would come at the start (a 2-minute job under the default 120 s
        was signalled, and so stopped, as soon as it began)."""
        return self.seconds_before_end if self.seconds_before_end < limit_s else int(limit_s // 2)


class Health(Frozen):
    """What the site's node health record (``hpcdist.store.records.health``) does to later submissions."""

    exclude_for_h: float = Field(
        default=24.0, ge=0, description="hours a node marked bad is excluded from every submit; 0: never"
    )


class Defaults(Frozen):
    """Per-job defaults a job spec may override."""

    time_min: int = Field(default=30, ge=1)
    timeout_s: float = Field(default=300.0, gt=0, description="process-group and rendezvous timeout")
    partition: str | None = None


class Site(Frozen):
    """A whole cluster: where jobs run and how they are started."""

    name: str = Field(min_length=1)
    scheduler: Literal["slurm", "local"]
    partitions: dict[str, Partition]
    account: str | None = None
    qos: str | None = None
    qos_max_time_min: int | None = Field(default=None, ge=1, description="the QOS's MaxWall: no job may ask more")
    gpu_request: Literal["gpus-per-node", "gres"] = Field(
        default="gpus-per-node",
        description="how jobs ask for GPUs: --gpus-per-node (select/cons_tres) or --gres=gpu:N")
    modules: tuple[str, ...] = ()
    setup: tuple[str, ...] = Field(default=(), description="shell lines run before the launch")
    env: EnvMap = Field(default_factory=dict)
    sbatch: dict[str, str] = Field(default_factory=dict, description="extra #SBATCH flags")
    launcher: Launcher = Field(default_factory=Launcher)
    network: Network = Field(default_factory=Network)
    storage: Storage
    preemption: Preemption = Field(default_factory=Preemption)
    health: Health = Field(default_factory=Health)
    defaults: Defaults = Field(default_factory=Defaults)
    baselines: Baselines = Field(default_factory=Baselines)
    python: str | None = Field(default=None, description="interpreter on the nodes")
    containers: dict[str, RuntimeSite] = Field(default_factory=dict, description="the container runtimes it has")
    container: Container | None = Field(default=None, description="every job's container, unless the job's own")
    tracking: Tracking | None = Field(default=None, description="every job's experiment trackers, unless its own")

    _runtimes = field_validator("containers")(classmethod(lambda cls, v: sites_runtimes(v)))

    @model_validator(mode="before")
    @classmethod
    def _auto_gpus_here_only(cls, data: object) -> object:
        """``gpus_per_node: auto`` counts the GPUs of the machine hpcdist runs on: the local
        site's nodes, never a Slurm partition's (a login node's GPUs say nothing of them)."""
        if isinstance(data, dict) and data.get("scheduler") != "local" and isinstance(data.get("partitions"), dict):
            for name, part in data["partitions"].items():
                if isinstance(part, dict) and part.get("gpus_per_node") == GPUS_AUTO:
                    raise ValueError(f"partitions.{name}.gpus_per_node: auto counts this machine's GPUs, which only "
                                     f"the local site runs on; give the GPUs of each node of partition {name!r}")
        return data

    @field_validator("env")
    @classmethod
    def _no_socket_ifname(cls, value: dict[str, str]) -> dict[str, str]:
        for var in SOCKET_IFNAME_VARS:
            if var in value:
                raise ValueError(
                    f"{var}={value[var]!r} is set from network.socket_ifname; set that instead "
                    f"(hpcdist sets {' and '.join(SOCKET_IFNAME_VARS)} from it on every rank)"
                )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Site:
        if not self.partitions:
            raise ValueError("a site needs at least one partition")
        if self.defaults.partition is not None and self.defaults.partition not in self.partitions:
            raise ValueError(
                f"defaults.partition {self.defaults.partition!r} is not one of the partitions "
                f"{sorted(self.partitions)}"
            )
        fitting = launcher_names(self.scheduler)
        if self.launcher.kind not in fitting:
            raise ValueError(
                f"a {self.scheduler} site cannot use launcher.kind {self.launcher.kind!r}; "
                f"use {' or '.join(repr(n) for n in fitting)}"
            )
        return self

    def partition(self, name: str | None) -> tuple[str, Partition]:
        """The named partition, or the site's default (first listed if none is set)."""
        chosen = name or self.defaults.partition or next(iter(self.partitions))
        return chosen, self.partitions[chosen]

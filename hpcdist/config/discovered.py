"""A site config made from the live Slurm cluster: what ``hpcdist site init`` writes, and the site
a job gets when it names none where ``srun`` is on PATH (submitit's rule).

``site_text(cluster, ...)`` turns what ``hpcdist.scheduler.slurm_cluster`` read into a site
YAML with a comment beside each value saying where it came from; what the cluster cannot tell
(the network interface, where shared storage is) is a commented line to fill in, never a guess.
``discovered_site()`` keeps that text per user (``$XDG_CACHE_HOME/hpcdist/sites/<cluster>.yaml``,
0600), stamped with the controller's configuration time: a changed slurm.conf is read again, and
so is a reading older than an hour (an account added or expired in sacctmgr).
The file is then an ordinary site file, loaded and validated as a written one is.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hpcdist._paths import cache_dir
from hpcdist.errors import ConfigError

if TYPE_CHECKING:
    from hpcdist.scheduler.slurm_text import Cluster, Node, Partition

SLURM = "slurm"  # the name that means "the Slurm cluster srun talks to, as discovered"
STAMP = "# configuration as of "
YEAR_MIN = 525600  # a partition whose MaxTime is UNLIMITED
SHARED_FS = ("lustre", "gpfs", "beegfs", "nfs", "nfs4", "wekafs", "cephfs", "panfs")
DEFAULT_TIME_MIN = 30


def user_sites_dir() -> Path:
    """Where ``hpcdist site init`` writes by default, on the ``--site NAME`` search path."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "hpcdist" / "sites"


def auto_site() -> str:
    """The site of a job that names none: the discovered Slurm site where ``srun`` is on PATH, as
    submitit's AutoExecutor picks Slurm, else ``local``."""
    return SLURM if shutil.which("srun") else "local"


def discovered_site() -> Path:
    """The cached site file of the cluster ``srun`` talks to, read again when the controller's
    configuration time differs from the one it was made at, when it is older than ``REREAD_S``
    (accounts and QOS change in sacctmgr, which no configuration time follows), when another
    hpcdist wrote it, or when it is missing."""
    from hpcdist.files.trust import private_folder
    from hpcdist.scheduler.slurm_cluster import config_stamp, read_cluster

    folder = cache_dir("sites")
    stamp = config_stamp()
    if stamp is not None and _fresh(folder / f"{_file_name(stamp[0])}.yaml", stamp[1]):
        return folder / f"{_file_name(stamp[0])}.yaml"
    cluster = read_cluster()
    text = site_text(cluster, cluster.name, cached=True)
    private_folder(folder)
    path = folder / f"{_file_name(cluster.name)}.yaml"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


REREAD_S = 3600.0  # a cached reading older than this is read again: an account change shows within the hour


def is_cached(path: Path) -> bool:
    """Whether `path` is hpcdist's own reading of a cluster (``discovered_site``), not a file someone wrote."""
    return path.parent.resolve() == cache_dir("sites").resolve()


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or SLURM


def _fresh(path: Path, as_of: str) -> bool:
    """Whether the cached reading at `path` was made by this hpcdist, from the configuration of
    `as_of`, less than ``REREAD_S`` ago."""
    try:
        if time.time() - path.stat().st_mtime >= REREAD_S:
            return False
        with path.open() as f:
            head = [line for line in f if line.startswith("#")][:3]
    except OSError:
        return False
    stamped = next((line[len(STAMP):].split(" ")[0].strip() for line in head if line.startswith(STAMP)), None)
    return stamped == as_of and any(f"(hpcdist {_version()})" in line for line in head)


# ---------------------------------------------------------------- the text


def _scalar(value: object) -> str:
    import yaml

    text: str = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


class _Lines:
    def __init__(self) -> None:
        self.out: list[str] = []

    def add(self, indent: int, key: str, value: object = None, why: str = "") -> None:
        head = " " * indent + f"{key}:" + ("" if value is None else f" {_scalar(value)}")
        self.out.append(f"{head:<40} # {why}" if why else head)

    def note(self, indent: int, text: str) -> None:
        self.out.append(" " * indent + f"# {text}")


def _nodes_named(nodes: tuple[object, ...]) -> str:
    names = [getattr(n, "name", "") for n in nodes]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _key(name: str) -> str:
    """A partition's name as a YAML key that reads back as that string (``'3090'``, ``'on'``)."""
    return _scalar(str(name))


def partition_cpus(part: Partition, nodes: tuple[Node, ...]) -> tuple[int, str]:
    """CPUs a job may have on each node (the fewest of `nodes`), and where that came from."""
    cpus = min(n.cpus for n in nodes)
    spec = [n for n in nodes if n.cpus < n.cpus_total]
    why = ("CPUTot of each node" if not spec and len({n.cpus for n in nodes}) == 1 else
           f"CPUEfctv: CPUTot {spec[0].cpus_total} less the cores CoreSpecCount keeps for the system" if spec
           and len({n.cpus for n in nodes}) == 1 else
           f"the fewest CPUs of its nodes ({sorted({n.cpus for n in nodes})})")
    if part.max_cpus_per_node is not None and part.max_cpus_per_node < cpus:
        cpus, why = part.max_cpus_per_node, f"MaxCPUsPerNode={part.max_cpus_per_node} of the partition"
    return cpus, why


def partition_memory(part: Partition, nodes: tuple[Node, ...], cpus: int) -> tuple[int, str]:
    """Memory a job may have on each node in MB (0: not known), and where that came from."""
    known = [n for n in nodes if n.memory_mb]
    if not known:
        return 0, "RealMemory=1 on its nodes: Slurm's default where the admin gives none"
    mem = min(n.memory_mb for n in known)
    kept = max(n.memory_spec_mb for n in known)
    why = (f"RealMemory less MemSpecLimit={kept} MB: {mem} MB" if kept else f"RealMemory {mem} MB") + (
        "" if len({n.memory_mb for n in known}) == 1 else ", the least of its nodes")
    if part.max_mem_per_node_mb and part.max_mem_per_node_mb < mem:
        mem, why = part.max_mem_per_node_mb, f"MaxMemPerNode={part.max_mem_per_node_mb} MB"
    if part.max_mem_per_cpu_mb and part.max_mem_per_cpu_mb * cpus < mem:
        mem, why = part.max_mem_per_cpu_mb * cpus, f"MaxMemPerCPU={part.max_mem_per_cpu_mb} MB x {cpus} CPUs"
    return mem, why


def _gpus(lines: _Lines, nodes: tuple[Node, ...], limit: int | None) -> None:
    gpu_nodes = tuple(n for n in nodes if n.gpus)
    if not gpu_nodes:
        lines.add(4, "gpus_per_node", 0, "no node of it has Gres=gpu")
        return
    counts = {n.gpus for n in gpu_nodes}
    where = "each node" if len(gpu_nodes) == len(nodes) else _nodes_named(gpu_nodes)
    gpus, why = min(counts), f"Gres=gpu on {where}" + ("" if len(counts) == 1 else f" (the fewest of {sorted(counts)})")
    if limit is not None and limit < gpus:
        gpus, why = limit, f"{_qos_words('gres/gpu')}: {limit} of the {min(counts)} a node has"
    lines.add(4, "gpus_per_node", gpus, why)
    mixed = sorted({", ".join(f"gpu:{t}:{c}" for t, c in n.gpu_types) for n in gpu_nodes if len(n.gpu_types) > 1})
    types = {n.gpu_type for n in gpu_nodes}
    if mixed:
        lines.note(4, f"gpu_type: a node holds GPUs of several GRES types ({'; '.join(mixed)}): gpus_per_node "
                      f"counts them all (a request naming no type takes any); name one to ask only for it")
    elif len(types) == 1 and None not in types:
        lines.add(4, "gpu_type", next(iter(types)), "the GRES type: requests name it")
    elif len(types) > 1:
        lines.note(4, f"gpu_type: its nodes' GPUs differ ({sorted(str(t) for t in types)}); "
                      f"name one to ask only for it")
    if any(n.gpus_shared for n in gpu_nodes):
        lines.note(4, "Gres=gpu:no_consume: its GPUs are shared by the jobs on a node, none is given to one alone")
    if len(gpu_nodes) < len(nodes):
        lines.add(4, "gpu_nodes", len(gpu_nodes), "only these of its nodes have GPUs")


def _partition_qos(part: Partition, cluster: Cluster) -> dict[str, int]:
    """The partition's own QOS (``QoS=``) limits on one job: its MaxTRESPerJob (node, gres/gpu) and
    MaxWall in minutes (``wall``); they hold every job of the partition, whatever QOS it asks."""
    qos = cluster.qos_limits.get(part.qos) if part.qos else None
    if qos is None:
        return {}
    found = {k: n for k, v in qos.max_tres_per_job.items() if (n := _count(v)) is not None}
    if qos.max_wall_min is not None:
        found["wall"] = qos.max_wall_min
    return found


def _count(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def _qos_words(tres: str) -> str:
    return f"the partition's QoS MaxTRESPerJob={tres}"


def _partition(lines: _Lines, part: Partition, cluster: Cluster) -> None:
    nodes = part.in_service
    lines.add(2, _key(part.name), None, f"scontrol show partition {part.name}: "
                                        f"Default={'YES' if part.default else 'NO'}, State={part.state}")
    away = [n for n in part.nodes if not n.in_service]
    gone = f" ({', '.join(f'{n.name} {n.state}' for n in away[:4])}{' ...' if len(away) > 4 else ''} left out)" \
        if away else ""
    limits = _partition_qos(part, cluster)
    count, why = len(nodes), f"its nodes: {_nodes_named(nodes)}{gone}"
    for limit, what in ((part.max_nodes, f"MaxNodes={part.max_nodes}"), (limits.get("node"), _qos_words("node"))):
        if limit is not None and limit < count:
            count, why = limit, f"{what}: a job may have {limit} of its {len(nodes)} nodes ({_nodes_named(nodes)})"
    lines.add(4, "nodes", count, why)
    cpus, why = partition_cpus(part, nodes)
    lines.add(4, "cpus_per_node", cpus, why)
    mem, why = partition_memory(part, nodes, cpus)
    mem_gb = int(mem / 1024 * 10) / 10
    if mem_gb > 0:
        lines.add(4, "mem_gb", mem_gb, why)
    else:
        lines.note(4, f"mem_gb: not written ({why}); a job asks memory with its own mem_gb")
    if part.def_mem_per_cpu_mb:
        lines.note(4, f"DefMemPerCPU={part.def_mem_per_cpu_mb} MB: a job that names no mem_gb gets that per CPU")
    _gpus(lines, nodes, limits.get("gres/gpu"))
    wall, why = part.max_time_min or YEAR_MIN, (f"MaxTime={part.max_time_min} min" if part.max_time_min
                                                else "MaxTime=UNLIMITED")
    if limits.get("wall") is not None and limits["wall"] < wall:
        wall, why = limits["wall"], f"MaxWall={limits['wall']} min of the partition's QoS {part.qos}"
    lines.add(4, "max_time_min", wall, why)
    features = sorted({f for n in nodes for f in n.features})
    if features:
        lines.note(4, f"node features (sbatch: {{constraint: ...}}): {', '.join(features)}")


def _partitions(lines: _Lines, cluster: Cluster) -> None:
    """Each partition that runs jobs on nodes in service; the others as a comment saying why not."""
    lines.add(0, "partitions")
    written = []
    for part in cluster.partitions:
        if not part.running:
            lines.note(2, f"partition {part.name}: not written: State={part.state}, it starts no job")
        elif not part.in_service:
            if part.nodes:
                lines.note(2, f"partition {part.name}: not written: none of its nodes takes jobs now "
                              f"({', '.join(sorted({n.state for n in part.nodes}))})")
        else:
            _partition(lines, part, cluster)
            written.append(part.name)
    if not written:
        states = ", ".join(f"{p.name} State={p.state}" for p in cluster.partitions) or "none at all"
        raise ConfigError(f"the Slurm cluster {cluster.name!r} has no partition that starts jobs on nodes in "
                          f"service now (scontrol show partition: {states}); `sinfo` shows its nodes' states")


def _account(lines: _Lines, cluster: Cluster) -> int | None:
    """The account and QOS lines; the QOS's MaxWall (which then holds every job), if any."""
    if not cluster.accounting:
        lines.note(0, "account: NAME   # accounting does not answer (sacctmgr): fill in if your site charges jobs")
        return None
    accounts = sorted({a.account for a in cluster.associations})
    if not accounts:
        lines.note(0, f"account: NAME   # sacctmgr: you have no association on cluster {cluster.name} "
                      f"(AccountingStorageEnforce={cluster.enforce}); fill in one your site gave you")
        return None
    if cluster.default_account:
        lines.add(0, "account", cluster.default_account,
                  f"sacctmgr: your default account (yours: {', '.join(accounts)}); "
                  f"AccountingStorageEnforce={cluster.enforce}")
    mine = [a for a in cluster.associations if a.account == cluster.default_account] or list(cluster.associations)
    qos = next((a.default_qos for a in mine if a.default_qos), "")
    if qos:
        lines.add(0, "qos", qos, f"the default QOS of your association (allowed: {', '.join(mine[0].qos)})")
        wall = cluster.qos_max_wall_min.get(qos)
        if wall:
            lines.add(0, "qos_max_time_min", wall, f"QOS {qos} MaxWall: no job of it may ask more")
            return wall
    return None


def _launcher(lines: _Lines, cluster: Cluster) -> bool:
    """The launcher lines; whether its steps use PMIx."""
    lines.add(0, "launcher")
    lines.add(2, "kind", "srun", "Slurm's own launcher")
    plugins = ", ".join(cluster.mpi_plugins) or "none listed"
    if cluster.mpi_default.startswith("pmix"):
        lines.note(2, f"MpiDefault={cluster.mpi_default}: srun starts PMIx for every step (srun --mpi=list: {plugins})")
        return True
    if "pmix" in cluster.mpi_plugins:
        lines.add(2, "args", {"srun": ["--mpi=pmix"]}, f"MpiDefault={cluster.mpi_default}; srun --mpi=list: {plugins}")
        return True
    lines.note(2, f"MpiDefault={cluster.mpi_default}; srun --mpi=list: {plugins} (no PMIx: MPI jobs need mpirun)")
    return False


def _containers(lines: _Lines, cluster: Cluster, pmix: bool) -> None:
    found = []
    if cluster.pyxis:
        found.append(("pyxis", "srun --help has --container-image (NVIDIA's pyxis over enroot)"))
    for program, runtime in (("apptainer", "apptainer"), ("singularity", "apptainer"), ("ch-run", "charliecloud"),
                             ("podman", "podman")):
        if shutil.which(program) and runtime not in {r for r, _ in found}:
            found.append((runtime, f"{program} is on PATH here ({shutil.which(program)}); the nodes need it too"))
    if shutil.which("enroot") and not cluster.pyxis:
        lines.note(0, "enroot is on PATH but srun has no --container-image: hpcdist runs enroot images through pyxis")
    if not found:
        lines.note(0, "containers: none found (no pyxis in srun --help; no apptainer, ch-run or podman on PATH)")
        return
    lines.add(0, "containers")
    for runtime, why in found:
        lines.add(2, runtime, None, why)
        if pmix and cluster.pmix_dir:
            lines.add(4, "pmix_dir", cluster.pmix_dir, "PMIxCliTmpDirBase, else TmpFS: bound in the container")
        else:
            lines.add(4, "args", [], "")


def _storage(lines: _Lines) -> None:
    lines.add(0, "storage", None, "relative paths are under the folder you submit from, as submitit's folder")
    for root in ("results", "checkpoints", "scratch", "logs"):
        lines.add(2, root, f"hpcdist-out/{root}")
    shared = shared_mounts()
    if shared:
        lines.note(2, "shared file systems in this machine's mount table (a root on one is seen by every node):")
        for mount, kind in shared:
            lines.note(2, f"  {mount} ({kind}): e.g. results: {mount}/$USER/hpcdist/results")
    else:
        lines.note(2, "no Lustre, GPFS, BeeGFS, NFS or Weka mount found: `hpcdist site check` tells whether these "
                      "folders are shared with the nodes")


def shared_mounts() -> list[tuple[str, str]]:
    """(mount point, type) of the shared file systems in the mount table, as candidates for roots."""
    found = []
    try:
        text = Path("/proc/mounts").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[2] in SHARED_FS:
            found.append((cells[1], cells[2]))
    return found


def site_text(cluster: Cluster, name: str, *, cached: bool = False, probe: dict[str, str] | None = None) -> str:
    """A site config for `cluster` as YAML, each value commented with where it came from."""
    lines = _Lines()
    made = (f"the site hpcdist uses where srun is on PATH and no site is named (hpcdist {_version()}), read again "
            f"after {int(REREAD_S // 60)} min") if cached else \
        f"written by `hpcdist site init` (hpcdist {_version()}): edit it, then `hpcdist site check {name}`"
    lines.note(0, f"Site {name!r}: the Slurm cluster {cluster.name!r} (Slurm {cluster.version}), read from it as "
                  f"user {cluster.user} on {time.strftime('%Y-%m-%d %H:%M')}; {made}.")
    lines.out.append(f"{STAMP}{cluster.as_of} (scontrol show config; a newer one is read again)")
    lines.add(0, "scheduler", "slurm")
    if cluster.gres_gpus:
        lines.add(0, "gpu_request", "gres", f"{cluster.select_type}: GPUs are asked as --gres=gpu:N")
    _partitions(lines, cluster)
    wall = _account(lines, cluster)
    pmix = _launcher(lines, cluster)
    _containers(lines, cluster, pmix)
    if probe and probe.get("ib_hcas"):
        lines.add(0, "network")
        lines.add(2, "ib_hcas", probe["ib_hcas"].split(), "--probe: /sys/class/infiniband on a node")
    else:
        lines.note(0, "network:")
        lines.note(2, "ib_hcas: [mlx5_0, ...]   # a node's InfiniBand HCAs: `hpcdist site init --probe` reads them")
    lines.note(2, "socket_ifname: IFACE       # the interface gloo and NCCL bootstrap over; unset: the one the "
                  "node's name resolves to")
    for key, what in (("gpu", "GPU model of a node"), ("tmp", "node-local scratch")):
        if probe and probe.get(key):
            lines.note(2, f"{what} (--probe): {probe[key]}")
    _storage(lines)
    default = cluster.default_partition
    lines.add(0, "defaults")
    if default is not None:
        lines.add(2, "partition", default.name, "Slurm's default partition (Default=YES)")
        limit = min(default.max_time_min or YEAR_MIN, default.default_time_min or DEFAULT_TIME_MIN,
                    wall or YEAR_MIN)
        why = (f"the QOS's MaxWall (under {default.default_time_min or DEFAULT_TIME_MIN})" if limit == wall else
               f"DefaultTime={default.default_time_min}" if default.default_time_min else
               f"hpcdist's {DEFAULT_TIME_MIN} min" if limit == DEFAULT_TIME_MIN else
               f"its MaxTime (under hpcdist's {DEFAULT_TIME_MIN})")
        lines.add(2, "time_min", limit, why)
    lines.note(0, f"python: PATH   # the nodes' interpreter; unset: the one hpcdist runs in ({sys.executable})")
    return "\n".join(lines.out) + "\n"


def _version() -> str:
    from hpcdist._version import __version__

    return __version__

"""A site config made from the live Slurm cluster: what ``hpcdist site init`` writes, and the site
a job gets when it names none where ``srun`` is on PATH (submitit's rule).

``site_text(cluster, ...)`` turns what ``hpcdist.scheduler.slurm_cluster`` read into a site
YAML with a comment beside each value saying where it came from; what the cluster cannot tell
(the network interface, where shared storage is) is a commented line to fill in, never a guess.
``discovered_site()`` keeps that text per user (``$XDG_CACHE_HOME/hpcdist/sites/<cluster>.yaml``,
0600), stamped with the controller's configuration time: a changed slurm.conf is read again.
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

if TYPE_CHECKING:
    from hpcdist.scheduler.slurm_cluster import Cluster, Partition

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
    configuration time differs from the one it was made at (or it is missing)."""
    from hpcdist.files.trust import private_folder
    from hpcdist.scheduler.slurm_cluster import config_stamp, read_cluster

    folder = cache_dir("sites")
    stamp = config_stamp()
    if stamp is not None and _stamp_of(folder / f"{_file_name(stamp[0])}.yaml") == stamp[1]:
        return folder / f"{_file_name(stamp[0])}.yaml"
    cluster = read_cluster()
    private_folder(folder)
    path = folder / f"{_file_name(cluster.name)}.yaml"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(site_text(cluster, cluster.name, cached=True))
    os.replace(tmp, path)
    return path


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or SLURM


def _stamp_of(path: Path) -> str | None:
    try:
        with path.open() as f:
            for line in f:
                if line.startswith(STAMP):
                    return line[len(STAMP):].split(" ")[0].strip()
                if not line.startswith("#"):
                    return None
    except OSError:
        return None
    return None


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


def _partition(lines: _Lines, part: Partition) -> None:
    nodes = part.nodes
    lines.add(2, part.name, None, f"scontrol show partition {part.name}: Default={'YES' if part.default else 'NO'}, "
                                  f"State={part.state}")
    lines.add(4, "nodes", len(nodes), f"its nodes: {_nodes_named(nodes)}")
    cpus = min(n.cpus for n in nodes)
    lines.add(4, "cpus_per_node", cpus, "CPUTot of each node" if len({n.cpus for n in nodes}) == 1
              else f"the fewest CPUTot of its nodes ({sorted({n.cpus for n in nodes})})")
    mem = min(n.memory_mb for n in nodes)
    why = f"RealMemory {mem} MB" + ("" if len({n.memory_mb for n in nodes}) == 1 else ", the least of its nodes")
    if part.max_mem_per_node_mb and part.max_mem_per_node_mb < mem:
        mem, why = part.max_mem_per_node_mb, f"MaxMemPerNode={part.max_mem_per_node_mb} MB"
    if mem:
        lines.add(4, "mem_gb", int(mem / 1024 * 10) / 10, why)
    if part.def_mem_per_cpu_mb:
        lines.note(4, f"DefMemPerCPU={part.def_mem_per_cpu_mb} MB: a job that names no mem_gb gets that per CPU")
    gpu_nodes = part.gpu_nodes
    if gpu_nodes:
        counts = {n.gpus for n in gpu_nodes}
        where = "each node" if len(gpu_nodes) == len(nodes) else _nodes_named(gpu_nodes)
        lines.add(4, "gpus_per_node", min(counts), f"Gres=gpu on {where}"
                  + ("" if len(counts) == 1 else f" (the fewest of {sorted(counts)})"))
        types = {n.gpu_type for n in gpu_nodes}
        if len(types) == 1 and None not in types:
            lines.add(4, "gpu_type", next(iter(types)), "the GRES type: requests name it")
        elif len(types) > 1:
            lines.note(4, f"gpu_type: its nodes' GPUs differ ({sorted(str(t) for t in types)}); "
                          f"name one to ask only for it")
        if len(gpu_nodes) < len(nodes):
            lines.add(4, "gpu_nodes", len(gpu_nodes), "only these of its nodes have GPUs")
    else:
        lines.add(4, "gpus_per_node", 0, "no node of it has Gres=gpu")
    lines.add(4, "max_time_min", part.max_time_min or YEAR_MIN,
              f"MaxTime={part.max_time_min} min" if part.max_time_min else "MaxTime=UNLIMITED")
    features = sorted({f for n in nodes for f in n.features})
    if features:
        lines.note(4, f"node features (sbatch: {{constraint: ...}}): {', '.join(features)}")


def _account(lines: _Lines, cluster: Cluster) -> int | None:
    """The account and QOS lines; the QOS's MaxWall (which then holds every job), if any."""
    if not cluster.accounting:
        lines.note(0, "account: NAME   # accounting does not answer (sacctmgr): fill in if your site charges jobs")
        return None
    accounts = sorted({a.account for a in cluster.associations})
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
    made = "the site hpcdist uses where srun is on PATH and no site is named" if cached else \
        f"written by `hpcdist site init` (hpcdist {_version()}): edit it, then `hpcdist site check {name}`"
    lines.note(0, f"Site {name!r}: the Slurm cluster {cluster.name!r} (Slurm {cluster.version}), read from it as "
                  f"user {cluster.user} on {time.strftime('%Y-%m-%d %H:%M')}; {made}.")
    lines.out.append(f"{STAMP}{cluster.as_of} (scontrol show config; a newer one is read again)")
    lines.add(0, "scheduler", "slurm")
    if cluster.gres_gpus:
        lines.add(0, "gpu_request", "gres", f"{cluster.select_type}: GPUs are asked as --gres=gpu:N")
    lines.add(0, "partitions")
    for part in cluster.partitions:
        if part.nodes:
            _partition(lines, part)
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

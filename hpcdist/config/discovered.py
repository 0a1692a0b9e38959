"""A site config made from the live Slurm cluster: what ``hpcdist site init`` writes, and the site
a job gets when it names none where ``srun`` is on PATH (submitit's rule).

``site_text(cluster, ...)`` turns what ``hpcdist.scheduler.slurm_cluster`` read into a site
YAML with a comment beside each value saying where it came from; what the cluster cannot tell
(the network interface, where shared storage is) is a commented line to fill in, never a guess.
``discovered_site()`` keeps that text per user (``$XDG_CACHE_HOME/hpcdist/sites/<cluster>.yaml``,
0600), stamped with a digest of the controller's configuration: a changed slurm.conf is read again,
and so is a reading older than an hour (an account added or expired in sacctmgr). The stamp is
asked at most once a minute (``CHECK_S``) for all of a user's hpcdist processes: a command, a
script's ``Executor`` and each of its submissions would otherwise each cost the controller a
``show config`` and the ping that scontrol sends with it.
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
from hpcdist.config.discovered_partitions import YEAR_MIN, Lines, write_partitions

if TYPE_CHECKING:
    from hpcdist.scheduler.slurm_text import Cluster

SLURM = "slurm"  # the name that means "the Slurm cluster srun talks to, as discovered"
STAMP = "# configuration "
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
    checked = _checked_recently(folder)
    if checked is not None:
        return checked
    stamp = config_stamp()
    if stamp is not None and _fresh(folder / f"{_file_name(stamp[0])}.yaml", stamp[1]):
        return _mark_checked(folder, folder / f"{_file_name(stamp[0])}.yaml")
    cluster = read_cluster()
    text = site_text(cluster, cluster.name, cached=True)
    private_folder(folder)
    path = folder / f"{_file_name(cluster.name)}.yaml"
    _write_private(facts_path(path), to_json(cluster))  # first: a current site file always has its facts
    _write_private(path, text)
    return _mark_checked(folder, path)


CHECK_S = 60.0  # a reading checked against the controller this recently is used without asking again


def _marker(folder: Path) -> Path:
    """Where the time of the last check of the cluster these commands reach is kept: one per
    scontrol, SLURM_CONF and login node (the test bed's clusters share one cache folder)."""
    from hpcdist.scheduler import ssh
    from hpcdist.scheduler.queue_cache import cluster_key

    return folder / f".checked-{cluster_key(ssh.login())}"


def _checked_recently(folder: Path) -> Path | None:
    """The reading checked within ``CHECK_S`` by any process of this user, if it is still this
    hpcdist's and within ``REREAD_S``; None to ask the controller."""
    marker = _marker(folder)
    try:
        if time.time() - marker.stat().st_mtime >= CHECK_S:
            return None
        path = folder / marker.read_text().strip()
        head = [line for line in path.read_text().splitlines()[:3] if line.startswith(STAMP)]
    except OSError:
        return None
    if path.parent != folder or not head or not _fresh(path, head[0][len(STAMP):].split(" ")[0]):
        return None
    return path


def _mark_checked(folder: Path, path: Path) -> Path:
    try:
        _write_private(_marker(folder), path.name)
    except OSError:  # a reading that cannot be marked is only asked again
        pass
    return path


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def facts_path(site_path: Path) -> Path:
    """Where the cached reading at `site_path` keeps the cluster's facts (``Cluster`` as JSON):
    its nodes one by one and its limits, which a site's keys cannot hold, for the checks at submit."""
    return site_path.with_suffix(".json")


def cached_cluster(site_path: Path) -> Cluster | None:
    """The facts kept beside the cached reading at `site_path`; None where there are none."""

    try:
        return from_json(facts_path(site_path).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        if time.time() - path.stat().st_mtime >= REREAD_S or not facts_path(path).is_file():
            return False
        with path.open() as f:
            head = [line for line in f if line.startswith("#")][:3]
    except OSError:
        return False
    stamped = next((line[len(STAMP):].split(" ")[0].strip() for line in head if line.startswith(STAMP)), None)
    return stamped == as_of and any(f"(hpcdist {_version()})" in line for line in head)


# ---------------------------------------------------------------- the text


def _account(lines: Lines, cluster: Cluster) -> int | None:
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


def _launcher(lines: Lines, cluster: Cluster) -> bool:
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


def _containers(lines: Lines, cluster: Cluster, pmix: bool) -> None:
    from hpcdist.scheduler import ssh  # `--on HOST`: the login node's PATH, not this laptop's

    found = []
    if cluster.pyxis:
        found.append(("pyxis", "srun --help has --container-image (NVIDIA's pyxis over enroot)"))
    runtimes = (("apptainer", "apptainer"), ("singularity", "apptainer"), ("ch-run", "charliecloud"),
                ("podman", "podman"))
    on_path = ssh.programs([program for program, _ in runtimes] + ["enroot"])
    for program, runtime in runtimes:
        if program in on_path and runtime not in {r for r, _ in found}:
            found.append((runtime, f"{program} is on PATH {ssh.where()} ({on_path[program]}); the nodes need it too"))
    if "enroot" in on_path and not cluster.pyxis:
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


def _storage(lines: Lines) -> None:
    lines.add(0, "storage", None, "relative paths are under the folder you submit from, as submitit's folder")
    for root in ("results", "checkpoints", "scratch", "logs"):
        lines.add(2, root, f"hpcdist-out/{root}")
    shared = shared_mounts()
    if shared:
        from hpcdist.scheduler import ssh

        lines.note(2, f"shared file systems in the mount table {ssh.where()} (a root on one is seen by every node):")
        for mount, kind in shared:
            lines.note(2, f"  {mount} ({kind}): e.g. results: {mount}/$USER/hpcdist/results")
    else:
        lines.note(2, "no Lustre, GPFS, BeeGFS, NFS or Weka mount found: `hpcdist site check` tells whether these "
                      "folders are shared with the nodes")


def shared_mounts() -> list[tuple[str, str]]:
    """(mount point, type) of the shared file systems in the mount table (the login node's under
    ``--on HOST``), as candidates for roots."""
    from hpcdist.scheduler import ssh

    found = []
    try:
        text = ssh.on_login_node(["cat", "/proc/mounts"]).stdout if ssh.login() else Path("/proc/mounts").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[2] in SHARED_FS:
            found.append((cells[1], cells[2]))
    return found


def site_text(cluster: Cluster, name: str, *, cached: bool = False, probe: dict[str, str] | None = None) -> str:
    """A site config for `cluster` as YAML, each value commented with where it came from."""
    lines = Lines()
    made = (f"the site hpcdist uses where srun is on PATH and no site is named (hpcdist {_version()}), read again "
            f"after {int(REREAD_S // 60)} min") if cached else \
        f"written by `hpcdist site init` (hpcdist {_version()}): edit it, then `hpcdist site check {name}`"
    lines.note(0, f"Site {name!r}: the Slurm cluster {cluster.name!r} (Slurm {cluster.version}), read from it as "
                  f"user {cluster.user} on {time.strftime('%Y-%m-%d %H:%M')}; {made}.")
    lines.out.append(f"{STAMP}{cluster.as_of} (scontrol show config; a changed one is read again)")
    lines.add(0, "scheduler", "slurm")
    if cluster.gres_gpus:
        lines.add(0, "gpu_request", "gres", f"{cluster.select_type}: GPUs are asked as --gres=gpu:N")

    write_partitions(lines, cluster)
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
    default, refused = cluster.partition_for(cluster.default_account)
    lines.add(0, "defaults")
    if default is not None:
        lines.add(2, "partition", default.name, f"Slurm's default {refused}; the first yours may use" if refused
                  else "Slurm's default partition (Default=YES)")
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


def to_json(cluster: Cluster) -> str:
    """`cluster` as JSON: what a cached reading keeps beside its site file for the checks at submit."""
    import dataclasses
    import json

    return json.dumps(dataclasses.asdict(cluster), sort_keys=True)


def from_json(text: str) -> Cluster:
    """The ``Cluster`` that ``to_json`` wrote; ValueError (KeyError, TypeError) for anything else."""
    import json

    from hpcdist.scheduler.slurm_text import Association, Cluster, Node, Partition, Qos

    data = json.loads(text)

    def node(d: dict[str, object]) -> Node:
        return Node(**{**d, "gpu_types": tuple(tuple(t) for t in d["gpu_types"]),  # type: ignore[arg-type, attr-defined]
                       "features": tuple(d["features"]), "partitions": tuple(d["partitions"])})  # type: ignore[arg-type]

    parts = tuple(Partition(**{**p, "nodes": tuple(node(n) for n in p["nodes"])}) for p in data.pop("partitions"))
    assocs = tuple(Association(**{**a, "qos": tuple(a["qos"])}) for a in data.pop("associations"))
    limits = {name: Qos(**q) for name, q in data.pop("qos_limits").items()}
    return Cluster(**{**data, "partitions": parts, "associations": assocs, "qos_limits": limits,
                      "mpi_plugins": tuple(data["mpi_plugins"]), "groups": tuple(data["groups"])})

"""``hpcdist site check``: every claim of a site config against the live Slurm cluster.

Each claim is one ``Claim`` row (what the site says, what the cluster says, whether they agree):
partitions exist and are up, their nodes, CPUs, memory, GPUs, GPU type and time limit are within
what their nodes have; the QOS's MaxWall; the MPI plugin the launcher asks for; the container
runtimes; the account and QOS as the cluster takes them (``sbatch --test-only``, which queues
nothing); and the storage roots, written on one node and read on another through ``srun``. The
cluster is read once (``hpcdist.scheduler.slurm_cluster``); the ``srun`` steps are the only
allocations, each bounded in time.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

from hpcdist.config.site import StorageRoot
from hpcdist.scheduler import ssh

if TYPE_CHECKING:
    from pathlib import Path

    from hpcdist.config.site import Partition, Site
    from hpcdist.login.limits import Ask
    from hpcdist.login.plan import Plan
    from hpcdist.scheduler.slurm_cluster import Cluster
    from hpcdist.scheduler.slurm_cluster import Partition as Live

STEP_TIMEOUT_S = 120.0  # an srun step waiting for its nodes longer than this reports "not checked"


@dataclass(frozen=True)
class Claim:
    key: str
    says: str
    cluster: str
    ok: bool | None  # None: could not be checked

    def line(self, site: str) -> str:
        return f"{site}: {self.key}: the site says {self.says}, the cluster {self.cluster}"


def _partition_claims(name: str, part: Partition, live: Live | None, cluster: Cluster) -> list[Claim]:
    key = f"partitions.{name}"
    if live is None:
        have = ", ".join(p.name for p in cluster.partitions)
        return [Claim(key, "it exists", f"has no such partition (it has: {have})", False)]
    from hpcdist.config.discovered_partitions import partition_cpus, partition_memory

    nodes = live.nodes
    serving = live.in_service or nodes  # what jobs get is judged on the nodes in service, if any is
    out = [Claim(key, "it exists", f"has it, State={live.state}", live.state == "UP")]
    out.append(Claim(f"{key}.nodes", str(part.nodes), f"has {len(nodes)} ({len(live.in_service)} in service)",
                     part.nodes <= len(nodes)))
    cpus, why = partition_cpus(live, serving) if serving else (0, "no node")
    out.append(Claim(f"{key}.cpus_per_node", str(part.cpus_per_node), f"gives a job {cpus} ({why})",
                     part.cpus_per_node <= cpus))
    if part.mem_gb is not None:
        mem, why = partition_memory(live, serving, cpus) if serving else (0, "no node")
        out.append(Claim(f"{key}.mem_gb", f"{part.mem_gb:g}", f"allows {mem} MB a node ({why})",
                         part.mem_gb * 1024 <= mem if mem else None))
    gpu_nodes = live.gpu_nodes
    gpus = max((n.gpus for n in gpu_nodes), default=0)  # the most of a node: a job is judged at submit
    if part.gpus_per_node:
        out.append(Claim(f"{key}.gpus_per_node", str(part.gpus_per_node),
                         f"has Gres=gpu:{gpus} on {len(gpu_nodes)} of its nodes" if gpu_nodes else "has no GPU GRES",
                         part.gpus_per_node <= gpus))
        out.append(Claim(f"{key}.gpu_nodes", str(part.nodes_with_gpus), f"has {len(gpu_nodes)} nodes with GPUs",
                         part.nodes_with_gpus <= len(gpu_nodes)))
        types = sorted({str(n.gpu_type) for n in gpu_nodes if n.gpu_type})
        if part.gpu_type or types:
            out.append(Claim(f"{key}.gpu_type", str(part.gpu_type), f"names its GPUs {', '.join(types) or 'untyped'}",
                             part.gpu_type in types if part.gpu_type else True))
    limit = live.max_time_min
    out.append(Claim(f"{key}.max_time_min", str(part.max_time_min),
                     f"MaxTime={limit if limit is not None else 'UNLIMITED'}",
                     limit is None or part.max_time_min <= limit))
    return out


def _runtime_claims(site: Site, cluster: Cluster) -> list[Claim]:
    out = []
    programs = {"apptainer": ("apptainer", "singularity"), "charliecloud": ("ch-run",), "podman": ("podman",)}
    for runtime in site.containers:
        if runtime == "pyxis":
            out.append(Claim(f"containers.{runtime}", "srun takes --container-image",
                             "'s srun does" if cluster.pyxis else "'s srun --help has no --container-image",
                             cluster.pyxis))
            continue
        on_path = ssh.programs(programs.get(runtime, ()))  # `--on HOST`: the login node's PATH
        found = next((on_path[p] for p in programs.get(runtime, ()) if p in on_path), None)
        out.append(Claim(f"containers.{runtime}", f"{runtime} is installed",
                         f"login node has {found}" if found else "login node has none of " +
                         ", ".join(programs.get(runtime, (runtime,))), found is not None))
    return out


def _mpi_claim(site: Site, cluster: Cluster) -> list[Claim]:
    if site.launcher.kind != "srun":
        return []
    asked = [a.split("=", 1)[1] for a in site.launcher.line_args if a.startswith("--mpi=")]
    if not asked:
        return []
    plugin = asked[-1]
    return [Claim("launcher.args --mpi", plugin, f"srun --mpi=list: {', '.join(cluster.mpi_plugins) or 'nothing'}",
                  plugin in cluster.mpi_plugins)]


def _test_only(site: Site) -> Claim:
    """The account, QOS and default partition as sbatch takes them, nothing queued."""
    from hpcdist.scheduler.slurm_cluster import test_only

    name, part = site.partition(None)
    minutes = min(site.defaults.time_min, part.max_time_min, site.qos_max_time_min or part.max_time_min)
    options = [f"--partition={name}", f"--time={minutes}", "--nodes=1"]
    options += [f"--account={site.account}"] if site.account else []
    options += [f"--qos={site.qos}"] if site.qos else []
    answer = test_only(options)
    says = f"account {site.account or '(default)'}, qos {site.qos or '(default)'} on {name}"
    if answer.ok:
        return Claim("account/qos", says, "takes them (sbatch --test-only)", True)
    return Claim("account/qos", says, f"refuses them: {answer.why.split(': ', 1)[-1]}", False)


def _qos_claim(site: Site, cluster: Cluster) -> list[Claim]:
    if site.qos is None:
        return []
    if not cluster.accounting:
        return [Claim(f"qos {site.qos}", "it exists", "'s accounting does not answer (sacctmgr)", None)]
    if site.qos not in cluster.qos_max_wall_min:
        return [Claim(f"qos {site.qos}", "it exists", f"has no such QOS ({', '.join(cluster.qos_max_wall_min)})",
                      False)]
    wall = cluster.qos_max_wall_min[site.qos]
    if site.qos_max_time_min is None:
        return [Claim("qos_max_time_min", "none", f"QOS {site.qos} MaxWall={wall} min", wall is None)]
    return [Claim("qos_max_time_min", str(site.qos_max_time_min), f"QOS {site.qos} MaxWall={wall}",
                  wall is None or site.qos_max_time_min <= wall)]


def _storage_claim(site: Site) -> Claim:
    """Each storage root written on one node and read on another (and on this login node)."""
    from hpcdist.files.trust import private_folder
    from hpcdist.scheduler.slurm_cluster import step

    name, part = site.partition(None)
    token = uuid.uuid4().hex
    probes = []
    for root in get_args(StorageRoot):
        folder = site.storage.root(root)
        try:
            if ssh.login():  # `--on HOST`: the login node's folders, made as private_folder makes them
                made = ssh.on_login_node(["sh", "-c", 'test -d "$1" || mkdir -p -m 0700 "$1"', "sh", str(folder)])
                if made.returncode:
                    raise OSError(made.returncode, made.stderr.strip() or "mkdir failed")
            elif not folder.exists():
                private_folder(folder)
        except OSError as exc:
            return Claim("storage", "its roots are shared", f"login node cannot make {folder}: {exc.strerror}", False)
        probes.append(folder / f".hpcdist-check-{token}")
    nodes = min(2, part.nodes)
    writer = " && ".join(f"echo $SLURMD_NODENAME > {p}" for p in probes)
    reader = " && ".join(f"test -s {p}" for p in probes)
    script = (f'if [ "$SLURM_PROCID" = 0 ]; then {writer}; exit; fi; '
              f'for i in $(seq 100); do {reader} && exit 0; sleep 0.1; done; exit 3')
    options = [f"--partition={name}", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--time=2",
               *([f"--account={site.account}"] if site.account else []), *([f"--qos={site.qos}"] if site.qos else [])]
    try:
        ran = step(options, ["sh", "-c", script], STEP_TIMEOUT_S)
        if ran.code is None:
            return Claim("storage", "its roots are shared", f"gave no nodes within {STEP_TIMEOUT_S:g} s", None)
        seen = (ssh.on_login_node(["sh", "-c", 'for p; do test -s "$p" || exit 1; done', "sh", *map(str, probes)])
                .returncode == 0 if ssh.login() else all(p.is_file() and p.read_text().strip() for p in probes))
        what = (f"{'two nodes' if nodes == 2 else 'a node'} and the login node see them" if ran.code == 0 and seen
                else f"srun exited {ran.code}: {ran.err.strip()[:200]}" if ran.code
                else "the login node does not see what a node wrote")
        return Claim("storage", "its roots are shared", what, ran.code == 0 and seen)
    finally:
        if ssh.login():
            ssh.on_login_node(["rm", "-f", *map(str, probes)])
        for p in probes:
            p.unlink(missing_ok=True)


def check(site: Site, cluster: Cluster, storage: bool = True) -> list[Claim]:
    """Every claim of `site` against `cluster`, in the order of the site file."""
    live = {p.name: p for p in cluster.partitions}
    claims = []
    for name, part in site.partitions.items():
        claims += _partition_claims(name, part, live.get(name), cluster)
    claims += _qos_claim(site, cluster)
    claims += _mpi_claim(site, cluster)
    claims += _runtime_claims(site, cluster)
    if all(c.ok is not False for c in claims if c.key.startswith("partitions.")):
        claims.append(_test_only(site))
        if storage:
            claims.append(_storage_claim(site))
    return claims


def against_cluster(plan: Plan) -> None:
    """One SubmitError, before sbatch, for the first thing the live cluster cannot give the job
    that its site says it can: a limit of the partition, its QoS, the job's QOS or the account
    rules, in the cluster's words (``hpcdist.login.limits``, judged on the nodes that can hold
    the job); a partition it does not have, more nodes, GPUs (of the type named), memory or time
    than its partition (or the QOS) allows. The cluster is the discovered site
    (``hpcdist.config.discovered``: one ``scontrol show config`` when its reading is current);
    a controller that does not answer leaves the verdict to sbatch."""
    from hpcdist.config import load_site
    from hpcdist.config.discovered import cached_cluster, discovered_site
    from hpcdist.config.spec import fit_to_site
    from hpcdist.errors import HpcdistError, SubmitError
    from hpcdist.login.limits import Ask, problems, too_few_nodes

    spec, site = plan.base, plan.site
    try:
        path = discovered_site()
        cluster = load_site(str(path))
    except (HpcdistError, OSError):  # no reading of the cluster: sbatch has the last word
        return
    facts, ask = cached_cluster(path), Ask.of(plan.directives)

    def refuse(problem: str | None) -> None:
        if problem:
            raise SubmitError(f"job {spec.name!r}: {problem}, so sbatch would refuse it or leave it pending for "
                              f"ever (`hpcdist site check {site.name}` compares the site with the cluster)")

    for problem in problems(facts, ask, nodes=False) if facts is not None else ():
        refuse(problem)
    if site.qos not in (None, cluster.qos):
        cluster = cluster.model_copy(update={"qos": site.qos, "qos_max_time_min": None})
    asked = spec.resources.model_copy(update={"partition": plan.partition, "time_min": plan.time_min,
                                              "cpus_per_task": plan.cpus_per_task})
    for key, value, allowed in fit_to_site(spec.model_copy(update={"resources": asked}), cluster):
        if key.startswith("resources."):
            raise SubmitError(f"job {spec.name!r}: {key}: {value!r} is not possible on the Slurm cluster "
                              f"{cluster.name!r}, whatever site {site.name!r} says; allowed: {allowed} "
                              f"(`hpcdist site check {site.name}` compares the site with the cluster)")
    refuse(too_few_nodes(facts, ask) if facts is not None else None)  # judged on the nodes that can hold it
    if facts is not None:
        now_against_cluster(spec.name, facts, ask, refuse)


def _shared(what: str) -> Path:
    """Where the user's hpcdist processes share what they read of this cluster (``queue_cache``)."""
    from hpcdist.login.jobindex import state_dir
    from hpcdist.scheduler import queue_cache

    return queue_cache.path_in(state_dir() / "queue", ssh.login(), what)


def now_against_cluster(name: str, facts: Cluster, ask: Ask, refuse: Callable[[str | None], None]) -> None:
    """What the cluster holds now, before sbatch: the reservations (the one the job names must
    let her in; those that hold for others the nodes it could have), and her own jobs under a
    QOS with per-user limits (squeue). A refusal is `refuse`d; a wait is one line on stderr, and
    the job is submitted."""
    import sys
    from datetime import datetime

    from hpcdist.login.limits import per_user, reservations
    from hpcdist.scheduler.slurm_cluster import current_reservations, my_jobs

    found = current_reservations(_shared("reservations"))
    refused, wait = reservations(facts, ask, found or [], datetime.now()) if found is not None else (None, "")
    refuse(refused)
    waits = [wait] if wait else []
    qos = [q for q in facts.qos_limits.values() if q.max_submit_per_user is not None or q.max_jobs_per_user
           or q.max_tres_per_user]
    jobs = my_jobs(facts.user) if qos and facts.user else None
    if jobs is not None:
        refusals, more = per_user(facts, ask, jobs)
        for problem in refusals:
            refuse(problem)
        waits += more
    for line in waits:
        print(f"hpcdist: job {name!r} will wait: {line}", file=sys.stderr, flush=True)

"""The partitions of a site read from the live cluster (``hpcdist.config.discovered``): what a
partition gives a job on one node, each value with where it came from; and the site file's lines
as discovery writes them (``Lines``: a key, its value as YAML, why).

Only nodes in service count (not DOWN, DRAIN or FUTURE). CPUs are ``CPUEfctv`` capped by the
partition's ``MaxCPUsPerNode``; memory is ``RealMemory`` less ``MemSpecLimit`` capped by
``MaxMemPerNode`` or ``MaxMemPerCPU`` x CPUs, and unknown where ``RealMemory=1``. Where its nodes
differ the largest is written: a job is judged at submit against the nodes that can hold it
(``hpcdist.login.limits``), never its smallest node. ``MaxNodes`` and the partition's own QoS
(MaxTRESPerJob, MaxWall) hold every job of it. A partition that starts no job is a comment, and
a name YAML would read otherwise (``3090``, ``on``) is quoted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcdist.errors import ConfigError

if TYPE_CHECKING:
    from hpcdist.scheduler.slurm_text import Cluster, Node, Partition


YEAR_MIN = 525600  # a partition whose MaxTime is UNLIMITED


def scalar(value: object) -> str:
    import yaml

    text: str = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


class Lines:
    def __init__(self) -> None:
        self.out: list[str] = []

    def add(self, indent: int, key: str, value: object = None, why: str = "") -> None:
        head = " " * indent + f"{key}:" + ("" if value is None else f" {scalar(value)}")
        self.out.append(f"{head:<40} # {why}" if why else head)

    def note(self, indent: int, text: str) -> None:
        self.out.append(" " * indent + f"# {text}")


def nodes_named(nodes: tuple[object, ...]) -> str:
    names = [getattr(n, "name", "") for n in nodes]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _key(name: str) -> str:
    """A partition's name as a YAML key that reads back as that string (``'3090'``, ``'on'``)."""
    return scalar(str(name))


DIFFER = "its nodes differ; a job is judged at submit against those that can hold it"


def partition_cpus(part: Partition, nodes: tuple[Node, ...]) -> tuple[int, str]:
    """CPUs a job may have on a node of `nodes` (where they differ, on the largest: a job is judged
    at submit against the nodes that can hold it, ``hpcdist.login.limits``), and where that came from."""
    counts = sorted({n.cpus for n in nodes})
    cpus = counts[-1]
    spec = [n for n in nodes if n.cpus < n.cpus_total]
    why = (f"the most CPUs of a node ({counts}): {DIFFER}" if len(counts) > 1 else
           f"CPUEfctv: CPUTot {spec[0].cpus_total} less the cores CoreSpecCount keeps for the system" if spec else
           "CPUTot of each node")
    if part.max_cpus_per_node is not None and part.max_cpus_per_node < cpus:
        cpus, why = part.max_cpus_per_node, f"MaxCPUsPerNode={part.max_cpus_per_node} of the partition"
    return cpus, why


def partition_memory(part: Partition, nodes: tuple[Node, ...], cpus: int) -> tuple[int, str]:
    """Memory a job may have on a node of `nodes` in MB (0: not known; where they differ, the
    largest), and where that came from."""
    known = [n for n in nodes if n.memory_mb]
    if not known:
        return 0, "RealMemory=1 on its nodes: Slurm's default where the admin gives none"
    mem = max(n.memory_mb for n in known)
    kept = max(n.memory_spec_mb for n in known)
    why = (f"RealMemory less MemSpecLimit={kept} MB: {mem} MB" if kept else f"RealMemory {mem} MB") + (
        "" if len({n.memory_mb for n in known}) == 1 else f", the most of a node: {DIFFER}")
    if part.max_mem_per_node_mb and part.max_mem_per_node_mb < mem:
        mem, why = part.max_mem_per_node_mb, f"MaxMemPerNode={part.max_mem_per_node_mb} MB"
    if part.max_mem_per_cpu_mb and part.max_mem_per_cpu_mb * cpus < mem:
        mem, why = part.max_mem_per_cpu_mb * cpus, f"MaxMemPerCPU={part.max_mem_per_cpu_mb} MB x {cpus} CPUs"
    return mem, why


def _gpus(lines: Lines, nodes: tuple[Node, ...], limit: int | None) -> None:
    gpu_nodes = tuple(n for n in nodes if n.gpus)
    if not gpu_nodes:
        lines.add(4, "gpus_per_node", 0, "no node of it has Gres=gpu")
        return
    counts = {n.gpus for n in gpu_nodes}
    where = "each node" if len(gpu_nodes) == len(nodes) else nodes_named(gpu_nodes)
    gpus, why = max(counts), f"Gres=gpu on {where}" + ("" if len(counts) == 1 else
                                                       f" (the most of a node, {sorted(counts)}: {DIFFER})")
    lines.add(4, "gpus_per_node", gpus, why)
    if limit is not None and limit < gpus:
        lines.note(4, f"{_qos_words('gres/gpu')}: a job may have {limit} (a job asking more is one line at submit)")
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
    MaxWall in minutes (``wall``); they hold every job of the partition, whatever QOS it asks.
    The wall caps ``max_time_min``; the others are a comment, and checked at submit
    (``hpcdist.login.limits``), where they are named."""
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


def _partition(lines: Lines, part: Partition, cluster: Cluster) -> None:
    nodes = part.in_service
    lines.add(2, _key(part.name), None, f"scontrol show partition {part.name}: "
                                        f"Default={'YES' if part.default else 'NO'}, State={part.state}")
    away = [n for n in part.nodes if not n.in_service]
    gone = f" ({', '.join(f'{n.name} {n.state}' for n in away[:4])}{' ...' if len(away) > 4 else ''} left out)" \
        if away else ""
    limits = _partition_qos(part, cluster)
    lines.add(4, "nodes", len(nodes), f"its nodes: {nodes_named(nodes)}{gone}")
    for limit, what in ((part.max_nodes, f"MaxNodes={part.max_nodes}"), (limits.get("node"), _qos_words("node"))):
        if limit is not None and limit < len(nodes):
            lines.note(4, f"{what}: a job may have {limit} of them (a job asking more is one line at submit)")
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


def write_partitions(lines: Lines, cluster: Cluster) -> None:
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

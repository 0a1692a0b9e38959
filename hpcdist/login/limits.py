"""What the cluster says is its limit, checked before sbatch: one line naming it in Slurm's words.

A job the partition's or a QOS's limits or the account rules forbid is refused by sbatch or
pends for ever (``PartitionNodeLimit``, ``QOSMaxGRESPerJob``, ``AccountNotAllowed``): a user
waits, or reads sbatch's terse error. ``problems(cluster, ask)`` finds it first, from the facts
discovery read (``hpcdist.scheduler.slurm_text.Cluster``: each node, each partition's
``MaxNodes``, ``QoS=``, ``AllowAccounts``/``DenyAccounts``, ``AllowQos``/``DenyQos``,
``AllowGroups``, each QOS's ``MaxTRESPerJob``, ``MaxTRESPerUser``, ``MaxJobsPerUser``,
``MaxSubmitJobsPerUser``), and says which limit, as ``scontrol`` and ``sacctmgr`` print it.

A partition whose nodes differ is judged against the nodes that can hold the job (enough CPUs,
memory, GPUs of the type asked, the features its constraint names), never its smallest node.
The ask is what sbatch would be given: the plan's ``#SBATCH`` options (``Ask.of``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcdist.scheduler.slurm_text import minutes

if TYPE_CHECKING:
    from datetime import datetime

    from hpcdist.scheduler.slurm_now import QueuedJob, Reservation
    from hpcdist.scheduler.slurm_text import Cluster, Node, Partition, Qos


@dataclass(frozen=True)
class Ask:
    """One job as sbatch is asked for it."""

    partition: str
    nodes: int
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    gpu_type: str | None = None
    mem_mb: int | None = None
    account: str | None = None  # None: the user's default account
    qos: str | None = None  # None: the association's default QOS
    array_tasks: int = 1
    constraint: str = ""
    time_min: int | None = None
    reservation: str | None = None

    @classmethod
    def of(cls, directives: Iterable[tuple[str, Any]]) -> Ask:
        """The ask of a plan's ``#SBATCH`` options (``hpcdist.login.plan.Plan.directives``)."""
        d: Mapping[str, Any] = dict(directives)
        gpus = str(d.get("gpus-per-node") or str(d.get("gres") or "").removeprefix("gpu:") or "0")
        gpu_type, _, count = gpus.rpartition(":")
        array = re.fullmatch(r"(\d+)-(\d+)(?:%\d+)?", str(d.get("array") or ""))
        mem = str(d.get("mem") or "")
        return cls(partition=str(d.get("partition") or ""), nodes=int(d.get("nodes") or 1),
                   tasks_per_node=int(d.get("ntasks-per-node") or 1), cpus_per_task=int(d.get("cpus-per-task") or 1),
                   gpus_per_node=int(count or 0), gpu_type=gpu_type or None,
                   mem_mb=int(mem.rstrip("M")) if mem.rstrip("M").isdigit() else None,
                   account=d.get("account") or None, qos=d.get("qos") or None,
                   array_tasks=int(array[2]) - int(array[1]) + 1 if array else 1,
                   constraint=str(d.get("constraint") or ""),
                   time_min=minutes(str(d["time"])) if d.get("time") else None,
                   reservation=str(d["reservation"]) if d.get("reservation") else None)

    @property
    def cpus_per_node(self) -> int:
        return self.tasks_per_node * self.cpus_per_task


def holds(node: Node, ask: Ask) -> bool:
    """Whether `node` can hold one node's share of `ask`."""
    if node.cpus < ask.cpus_per_node or (ask.mem_mb and node.memory_mb and node.memory_mb < ask.mem_mb):
        return False
    if ask.gpus_per_node:
        have = dict(node.gpu_types).get(ask.gpu_type, 0) if ask.gpu_type else node.gpus
        if have < ask.gpus_per_node:
            return False
    wanted = set(re.findall(r"[\w.-]+", ask.constraint))
    return not (wanted and "|" not in ask.constraint and not wanted <= set(node.features))


def _access(part: Partition, cluster: Cluster, account: str | None, qos: str | None) -> str | None:
    return part.refusal(account, qos, cluster.user, cluster.groups)


def _tres(ask: Ask) -> dict[str, int]:
    """The job's TRES as a QOS counts them (sacctmgr's names)."""
    return {"node": ask.nodes, "cpu": ask.nodes * ask.cpus_per_node,
            "gres/gpu": ask.nodes * ask.gpus_per_node, **({"mem": ask.nodes * ask.mem_mb} if ask.mem_mb else {})}


def _amount(value: str) -> int | None:
    """A TRES limit (``8``, ``64000``, ``500G``, ``2T``) as a number (memory in MB)."""
    m = re.fullmatch(r"(\d+)([MGT]?)", value.strip())
    return None if m is None else int(m[1]) * {"": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m[2]]


def _qos_limits(qos: Qos, ask: Ask, whose: str) -> str | None:
    asked = _tres(ask)
    for field, limits in (("MaxTRESPerJob", qos.max_tres_per_job), ("MaxTRESPerUser", qos.max_tres_per_user)):
        for name, value in limits.items():
            limit = _amount(value)
            if limit is not None and asked.get(name, 0) > limit:
                return (f"{whose} {qos.name!r} has {field}={name}={value}: the job asks {name}={asked[name]}"
                        + (", more than she may have at once" if field == "MaxTRESPerUser" else ""))
    if qos.max_wall_min is not None and ask.time_min is not None and ask.time_min > qos.max_wall_min:
        return f"{whose} {qos.name!r} has MaxWall={qos.max_wall_min} min: the job asks {ask.time_min} min"
    if qos.max_jobs_per_user == 0:
        return f"{whose} {qos.name!r} has MaxJobsPerUser=0: no job of hers runs under it"
    if qos.max_submit_per_user is not None and ask.array_tasks > qos.max_submit_per_user:
        return (f"{whose} {qos.name!r} has MaxSubmitJobsPerUser={qos.max_submit_per_user}: the array has "
                f"{ask.array_tasks} tasks")
    return None


def _nodes(part: Partition, ask: Ask) -> str | None:
    serving = part.in_service
    features = sorted({f for n in part.nodes for f in n.features})
    unknown = [f for f in re.findall(r"[A-Za-z_][\w.-]*", ask.constraint) if f not in features]
    if unknown:
        return (f"no node of partition {part.name!r} has the feature {unknown[0]!r} the constraint names "
                f"(AvailableFeatures of its nodes: {', '.join(features) or 'none'})")
    fit = [n for n in serving if holds(n, ask)]
    if len(fit) >= ask.nodes:
        return None
    what = [f"{ask.cpus_per_node} CPUs"] + ([f"{ask.mem_mb} MB"] if ask.mem_mb else []) + (
        [f"{ask.gpus_per_node} GPUs" + (f" of type {ask.gpu_type}" if ask.gpu_type else "")] if ask.gpus_per_node
        else []) + ([f"features {ask.constraint}"] if ask.constraint else [])
    have = ", ".join(f"{n.name}: {n.cpus} CPUs" + (f", {n.memory_mb} MB" if n.memory_mb else "")
                     + (f", Gres=gpu:{n.gpus}" if n.gpus else "") for n in serving[:6])
    return (f"partition {part.name!r} has {len(fit)} node{'s' * (len(fit) != 1)} in service with "
            f"{' and '.join(what)} a node, the job asks {ask.nodes} ({have}{' ...' if len(serving) > 6 else ''})")


def problems(cluster: Cluster, ask: Ask, nodes: bool = True) -> list[str]:
    """Each limit of `cluster` that `ask` is over, in the cluster's own words; [] when none is.
    The access rules, MaxNodes and the QOS limits first, then (unless `nodes` is False) whether
    enough of the partition's nodes in service can hold it."""
    part = next((p for p in cluster.partitions if p.name == ask.partition), None)
    if part is None:
        return []  # a partition it does not have: the site's check says so
    account = ask.account or cluster.default_account
    mine = [a for a in cluster.associations if a.account == account] or list(cluster.associations)
    qos = ask.qos or next((a.default_qos for a in mine if a.default_qos), None)
    found = [p for p in [_access(part, cluster, account, qos)] if p]
    if part.max_nodes is not None and ask.nodes > part.max_nodes:
        found.append(f"partition {part.name!r} has MaxNodes={part.max_nodes}: the job asks {ask.nodes} nodes")
    if part.qos and part.qos in cluster.qos_limits:
        found += [p for p in [_qos_limits(cluster.qos_limits[part.qos], ask, "the partition's QoS")] if p]
    if qos and qos in cluster.qos_limits and qos != part.qos:
        found += [p for p in [_qos_limits(cluster.qos_limits[qos], ask, "QOS")] if p]
    if nodes:
        found += [p for p in [_nodes(part, ask)] if p]
    return found


def too_few_nodes(cluster: Cluster, ask: Ask) -> str | None:
    """Whether fewer of the partition's nodes in service than `ask` names can hold it."""
    part = next((p for p in cluster.partitions if p.name == ask.partition), None)
    return None if part is None else _nodes(part, ask)


def _job_qos(cluster: Cluster, ask: Ask) -> tuple[str | None, list[tuple[Qos, str]]]:
    """The job's account, and the QOS that hold it: the partition's own, then the job's (asked,
    else her association's default), each with how a line names it."""
    account = ask.account or cluster.default_account
    mine = [a for a in cluster.associations if a.account == account] or list(cluster.associations)
    qos = ask.qos or next((a.default_qos for a in mine if a.default_qos), None)
    part = next((p for p in cluster.partitions if p.name == ask.partition), None)
    held = [(cluster.qos_limits[part.qos], "the partition's QoS")] if part and part.qos in cluster.qos_limits else []
    if qos and qos in cluster.qos_limits and (part is None or qos != part.qos):
        held.append((cluster.qos_limits[qos], "QOS"))
    return account, held


def room(cluster: Cluster, ask: Ask, jobs: list[QueuedJob]) -> tuple[int | None, str]:
    """How many more of `ask`'s tasks the QOS that hold it take now under MaxSubmitJobsPerUser
    beside her `jobs` (squeue, one per array task), and that limit in the cluster's words; None
    where no such limit holds it (``hpcdist.login.arrays`` holds the rest of an array back)."""
    least: int | None = None
    words = ""
    for qos, whose in _job_qos(cluster, ask)[1]:
        if qos.max_submit_per_user is None:
            continue
        partition_qos = whose.startswith("the partition")  # it charges every job of the partition
        under = [j for j in jobs if (j.partition == ask.partition if partition_qos else j.qos == qos.name)]
        free = max(0, qos.max_submit_per_user - len(under))
        if least is None or free < least:
            least, words = free, (f"{whose} {qos.name!r} has MaxSubmitJobsPerUser={qos.max_submit_per_user} and "
                                  f"{len(under)} of her jobs are queued or running under it")
    return least, words


def per_user(cluster: Cluster, ask: Ask, jobs: list[QueuedJob]) -> tuple[list[str], list[str]]:
    """What a QOS's per-user limits make of `ask` beside her `jobs` now (squeue, one per array
    task): (refusals, waits). sbatch refuses a job over MaxSubmitJobsPerUser; one over
    MaxJobsPerUser or MaxTRESPerUser with hers running waits until enough of them end."""
    refused, waits = [], []
    for qos, whose in _job_qos(cluster, ask)[1]:
        partition_qos = whose.startswith("the partition")  # it charges every job of the partition
        under = [j for j in jobs if (j.partition == ask.partition if partition_qos else j.qos == qos.name)]
        running = [j for j in under if j.running]
        ids = ", ".join(j.job_id for j in under[:6]) + (" ..." if len(under) > 6 else "")
        if qos.max_submit_per_user is not None and len(under) + ask.array_tasks > qos.max_submit_per_user:
            refused.append(f"{whose} {qos.name!r} has MaxSubmitJobsPerUser={qos.max_submit_per_user}: {len(under)} "
                           f"of her jobs are queued or running under it ({ids}) and this one adds {ask.array_tasks}")
        if qos.max_jobs_per_user and len(running) >= qos.max_jobs_per_user:
            waits.append(f"{whose} {qos.name!r} has MaxJobsPerUser={qos.max_jobs_per_user} and {len(running)} of "
                         f"her jobs run under it ({', '.join(j.job_id for j in running[:6])}): this one waits for "
                         f"one to end")
        used = {"node": sum(j.nodes for j in running), "cpu": sum(j.cpus for j in running),
                "gres/gpu": sum(j.gpus for j in running)}
        for name, value in qos.max_tres_per_user.items():
            limit, asked = _amount(value), _tres(ask).get(name, 0)
            if limit is not None and name in used and asked <= limit < used[name] + asked:
                waits.append(f"{whose} {qos.name!r} has MaxTRESPerUser={name}={value} and her running jobs "
                             f"hold {name}={used[name]}: this one (asking {asked}) waits for enough to end")
    return refused, waits


def reservations(cluster: Cluster, ask: Ask, found: list[Reservation], now: datetime) -> tuple[str | None, str]:
    """What the reservations of the cluster now make of `ask`: (a refusal, a wait). The reservation
    it names must be there and let her in; without one, nodes that reservations hold for
    others during the job's time may leave too few of those that can hold it until one ends."""
    from datetime import timedelta

    from hpcdist.scheduler.hostlist import expand_hostlist
    from hpcdist.scheduler.slurm_now import may_use, when

    account = _job_qos(cluster, ask)[0]
    if ask.reservation:
        named = next((r for r in found if r.name == ask.reservation), None)
        if named is None:
            return (f"there is no reservation {ask.reservation!r} (scontrol show reservation: "
                    f"{', '.join(r.name for r in found) or 'none'})"), ""
        if not may_use(named, cluster.user, account):
            return (f"reservation {named.name!r} has Users={named.users or '(null)'} Accounts="
                    f"{named.accounts or '(null)'}: user {cluster.user} (account {account!r}) may not use it"), ""
        return None, ""
    part = next((p for p in cluster.partitions if p.name == ask.partition), None)
    if part is None:
        return None, ""
    fit = {n.name for n in part.in_service if holds(n, ask)}
    span = ask.time_min or part.default_time_min or part.max_time_min or 0
    held: list[tuple[Reservation, set[str]]] = []
    for r in found:
        start, end = when(r.start), when(r.end)
        if start is None or end is None or end <= now or start >= now + timedelta(minutes=span):
            continue
        if may_use(r, cluster.user, account):
            continue
        names = {n.name for n in part.nodes} if r.nodes == "ALL" else set(expand_hostlist(r.nodes))
        if names & fit:
            held.append((r, names & fit))
    left = fit - set().union(*(names for _, names in held)) if held else fit
    if len(fit) < ask.nodes or len(left) >= ask.nodes:
        return None, ""
    return None, (f"{'; '.join(r.line() for r, _ in held)}: {len(fit) - len(left)} of the {len(fit)} nodes of "
                  f"partition {part.name!r} that can hold it, so it waits until then")

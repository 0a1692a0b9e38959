"""What Slurm's commands print, read into facts: pure functions of text, no command run here.

``hpcdist.scheduler.slurm_cluster`` asks the commands (``scontrol show config``, ``scontrol -o
show node|partition``, ``srun --mpi=list``, ``sacctmgr -n -P``) and hands their text to
``cluster_from``; the tests hand it captured text of each release and of real clusters' shapes
(tests/fixtures/slurm/). Everything a release or an admin may print differently is decided here:
a node's usable CPUs and memory (``CPUEfctv``, ``CoreSpecCount``, ``MemSpecLimit``; ``RealMemory=1``
is Slurm's "not configured"), its GPUs by GRES type (MIG profiles, mixed models, ``no_consume``),
whether it is in service (DOWN, DRAIN, FUTURE are not), a partition's limits and access lists,
a QOS's limits, and the MPI plugins of every ``srun --mpi=list`` format since 20.11. Standard
library only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from hpcdist.scheduler.slurm_json import node_fields

UNLIMITED = None  # a limit Slurm reports as UNLIMITED, INFINITE or NONE

# ``Key=Value`` pairs of one ``scontrol -o`` line; a value may hold spaces (OS=Linux 6.1 #1 SMP)
_PAIR = re.compile(r"(\w+)=(.*?)(?=\s+\w+=|\s*$)")
# a node's states that take no job now: its base state, or a flag after it (IDLE+DRAIN)
OUT_OF_SERVICE = frozenset({"DOWN", "FUTURE", "ERROR", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING",
                            "INVALID_REG", "REBOOT_ISSUED"})
NOT_RUNNING = ("DOWN", "INACTIVE", "DRAIN")  # partition states that start no new job (scontrol's State=)


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int  # what jobs may use: CPUEfctv (CPUTot less the specialized cores)
    memory_mb: int  # RealMemory less MemSpecLimit; 0: not configured (RealMemory=1, Slurm's default)
    memory_spec_mb: int = 0  # MemSpecLimit: kept for the node's daemons, not given to jobs
    gpus: int = 0  # of every GRES type together (an untyped request takes any of them)
    gpu_type: str | None = None  # the one GRES type of its GPUs; None: untyped, or of several types
    gpu_types: tuple[tuple[str, int], ...] = ()  # each type and its count: (("1g.10gb", 7), ("3g.40gb", 2))
    features: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    state: str = ""
    cpus_total: int = 0  # CPUTot
    gpus_shared: bool = False  # gpu:no_consume: jobs share them, none is taken

    @property
    def in_service(self) -> bool:
        """Whether Slurm may start a job on it now: not DOWN, DRAIN(ED|ING), FAIL or FUTURE (a
        node announced but not yet there). Not responding alone (``IDLE*``) is a busy node's."""
        words = set(self.state.rstrip("*~#!%$@^-").upper().split("+"))
        return not words & OUT_OF_SERVICE


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[Node, ...]  # every node it lists, in service or not
    default: bool = False
    max_time_min: int | None = UNLIMITED
    default_time_min: int | None = UNLIMITED
    def_mem_per_cpu_mb: int | None = None
    max_mem_per_node_mb: int | None = None
    max_mem_per_cpu_mb: int | None = None
    max_cpus_per_node: int | None = None
    max_nodes: int | None = None
    state: str = "UP"
    qos: str = ""  # the partition's own QOS (QoS=), "" for none
    allow_qos: str = "ALL"
    deny_qos: str = ""
    allow_accounts: str = "ALL"
    deny_accounts: str = ""
    allow_groups: str = "ALL"

    @property
    def in_service(self) -> tuple[Node, ...]:
        """Its nodes that may take a job now."""
        return tuple(n for n in self.nodes if n.in_service)

    @property
    def gpu_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.in_service if n.gpus)

    @property
    def running(self) -> bool:
        """State=UP: it starts jobs (DOWN queues them for ever, INACTIVE and DRAIN refuse them)."""
        return self.state not in NOT_RUNNING

    def refusal(self, account: str | None, qos: str | None, user: str, groups: tuple[str, ...]) -> str | None:
        """Why its access lists refuse a job of `account` under `qos` by `user` (in `groups`), in
        scontrol's words; None where they let it in (or cannot tell: no groups known)."""
        where = f"partition {self.name!r} has"
        if account and self.allow_accounts not in ("", "ALL") and account not in _names(self.allow_accounts):
            return f"{where} AllowAccounts={self.allow_accounts}: account {account!r} may not use it"
        if account and account in _names(self.deny_accounts):
            return f"{where} DenyAccounts={self.deny_accounts}: account {account!r} may not use it"
        if qos and self.allow_qos not in ("", "ALL") and qos not in _names(self.allow_qos):
            return f"{where} AllowQos={self.allow_qos}: QOS {qos!r} may not use it"
        if qos and qos in _names(self.deny_qos):
            return f"{where} DenyQos={self.deny_qos}: QOS {qos!r} may not use it"
        if self.allow_groups not in ("", "ALL") and groups and not set(_names(self.allow_groups)) & set(groups):
            return (f"{where} AllowGroups={self.allow_groups}: user {user} is in none of them "
                    f"(her groups: {', '.join(groups)})")
        return None


_names = re.compile(r"[^,]+").findall  # the names of a comma-separated list, empty ones left out


@dataclass(frozen=True)
class Association:
    """One of the user's associations: an account and the QOS it may use (sacctmgr)."""

    account: str
    partition: str = ""
    qos: tuple[str, ...] = ()
    default_qos: str = ""


@dataclass(frozen=True)
class Qos:
    """A QOS's limits as sacctmgr prints them; a TRES limit by its name there (cpu, node, gres/gpu)."""

    name: str
    max_wall_min: int | None = UNLIMITED
    max_tres_per_job: dict[str, str] = field(default_factory=dict)
    max_tres_per_user: dict[str, str] = field(default_factory=dict)
    max_jobs_per_user: int | None = None
    max_submit_per_user: int | None = None


@dataclass(frozen=True)
class Cluster:
    name: str
    as_of: str  # the controller's configuration stamp (``as_of``): a change of slurm.conf changes it
    max_array_size: int = 1001  # MaxArraySize: an array's task indices are below it (Slurm's default)
    version: str = ""
    mpi_default: str = "none"
    mpi_plugins: tuple[str, ...] = ()
    select_type: str = ""
    accounting: bool = False  # sacctmgr answered for this user
    enforce: str = "none"  # AccountingStorageEnforce
    default_account: str | None = None
    associations: tuple[Association, ...] = ()
    qos_max_wall_min: dict[str, int | None] = field(default_factory=dict)
    qos_limits: dict[str, Qos] = field(default_factory=dict)
    pyxis: bool = False
    pmix_dir: str | None = None  # where srun --mpi=pmix keeps its sockets: PMIxCliTmpDirBase, else TmpFS
    partitions: tuple[Partition, ...] = ()
    user: str = ""
    groups: tuple[str, ...] = ()  # the user's groups, for a partition's AllowGroups

    @property
    def gres_gpus(self) -> bool:
        """``--gpus-per-node`` needs select/cons_tres; the older plugins take ``--gres=gpu:N``."""
        return self.select_type != "select/cons_tres"

    @property
    def default_partition(self) -> Partition | None:
        """Slurm's default partition when it runs jobs, else the first that does."""
        running = [p for p in self.partitions if p.running and p.in_service]
        return next((p for p in running if p.default), running[0] if running else None)

    def partition_for(self, account: str | None) -> tuple[Partition | None, str]:
        """The partition a job of `account` goes to by default: Slurm's default where its access
        lists let her in, else the first running one that does; and why, when it is not Slurm's."""
        default = self.default_partition
        refused = default.refusal(account, None, self.user, self.groups) if default is not None else None
        if refused is None:
            return default, ""
        running = [p for p in self.partitions if p.running and p.in_service]
        other = next((p for p in running if p.refusal(account, None, self.user, self.groups) is None), None)
        return (other, refused) if other is not None else (default, "")


@dataclass(frozen=True)
class Texts:
    """What each command printed; ``assoc`` None where sacctmgr did not answer (or is not used);
    ``nodes`` may be "" where ``nodes_json`` holds them."""

    config: str
    nodes: str
    partitions: str
    mpi_list: str = ""
    assoc: str | None = None
    user: str = ""
    qos: str = ""
    srun_help: str = ""
    nodes_json: str = ""  # scontrol --json show node, where the release prints it: read before the text


def minutes(value: str) -> int | None:
    """A Slurm duration (``MaxTime=1-02:00:00``, ``30:00``, ``60``, ``UNLIMITED``) in whole minutes."""
    value = value.strip()
    if value.upper() in ("UNLIMITED", "INFINITE", "NONE", "", "N/A"):
        return UNLIMITED
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 3:  # H:M:S
        total = parts[0] * 60 + parts[1] + (parts[2] > 0)
    elif len(parts) == 2:  # M:S, or H:M after a day count
        total = parts[0] * 60 + parts[1] if days else parts[0] + (parts[1] > 0)
    else:  # minutes, or hours after a day count
        total = parts[0] * 60 if days else parts[0]
    return total + int(days or 0) * 1440


def pairs(line: str) -> dict[str, str]:
    """The fields of one ``scontrol -o`` line. The first of a key wins: free text printed after the
    real fields (``Reason=``, ``Comment=``, ``Extra=``) may hold ``Gres=...`` and must not replace them."""
    found: dict[str, str] = {}
    for key, value in _PAIR.findall(line):
        found.setdefault(key, value.strip())
    return found


def config(out: str) -> dict[str, str]:
    """``scontrol show config``'s ``Key = Value`` lines."""
    conf: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            conf[key.strip()] = value.strip()
    return conf


def as_of(out: str) -> str:
    """A digest of ``scontrol show config`` less what changes without slurm.conf (measured on 22.05,
    24.11, 26.05): its first line (the time of the answer), NEXT_JOB_ID and the ping lines at its end."""
    kept = [x for x in out.splitlines()[1:] if not re.match(r"Slurmctld\(\w+\) at .* is |NEXT_JOB_ID\b", x)]
    return f"sha1-{hashlib.sha1(chr(10).join(kept).encode()).hexdigest()[:16]}" if out else ""


def number(value: str | None) -> int | None:
    """An integer field (``4000``, ``4000M``); None for UNLIMITED, N/A, (null) or nothing."""
    try:
        return int(str(value).rstrip("M"))
    except (TypeError, ValueError):
        return None


def gres_gpus(gres: str) -> tuple[int, tuple[tuple[str, int], ...], bool]:
    """A node's ``Gres=`` field read for GPUs: their count, each type's count, and whether they are
    ``no_consume``. ``gpu:a100:4(S:0-1)``, ``gpu:1g.10gb:7,gpu:3g.40gb:2``, ``gpu:no_consume:4``,
    ``gpu:4``; other GRES (``shard:8``, ``mps:100``) are not GPUs."""
    count, shared = 0, False
    types: dict[str, int] = {}
    for item in re.split(r",(?![^(]*\))", gres):  # a socket list (S:0,1) is not an item
        cells = item.split("(", 1)[0].strip().split(":")
        if cells[0] != "gpu" or len(cells) < 2:
            continue
        if "no_consume" in cells:
            shared = True
            cells = [c for c in cells if c != "no_consume"]
        n = number(re.sub(r"[^\d].*$", "", cells[-1])) if len(cells) > 1 else None
        if n is None:
            continue
        count += n
        if len(cells) > 2:
            types[cells[1]] = types.get(cells[1], 0) + n
    return count, tuple(types.items()), shared


def node_of(fields: dict[str, str]) -> Node:
    """One node from its fields by ``scontrol -o show node``'s names (``slurm_json`` maps the
    JSON's onto them): what a job may use of it."""
    total = number(fields.get("CPUTot")) or 1
    cpus = number(fields.get("CPUEfctv"))
    if cpus is None:  # before 22.05: CPUTot less the specialized cores' threads
        cpus = total - (number(fields.get("CoreSpecCount")) or 0) * (number(fields.get("ThreadsPerCore")) or 1)
    real = number(fields.get("RealMemory")) or 0
    kept = number(fields.get("MemSpecLimit")) or 0
    count, types, shared = gres_gpus(fields.get("Gres", ""))
    return Node(
        name=fields["NodeName"], cpus=max(cpus, 1), memory_mb=0 if real <= 1 else max(real - kept, 0),
        memory_spec_mb=kept, gpus=count,
        gpu_type=types[0][0] if len(types) == 1 and types[0][1] == count else None, gpu_types=types,
        features=tuple(f for f in fields.get("AvailableFeatures", "").split(",") if f and f != "(null)"),
        partitions=tuple(p for p in fields.get("Partitions", "").split(",") if p),
        state=fields.get("State", ""), cpus_total=total, gpus_shared=shared,
    )


def nodes(out: str) -> list[Node]:
    """``scontrol -o show node``: each node with what a job may use of it."""
    return [node_of(fields) for fields in map(pairs, out.splitlines()) if "NodeName" in fields]


def nodes_json(out: str) -> list[Node] | None:
    """``scontrol --json show node`` (``hpcdist.scheduler.slurm_json``): the same nodes; None
    where `out` is not that JSON."""
    rows = node_fields(out)
    try:
        return None if rows is None else [node_of(fields) for fields in rows]
    except KeyError:  # a node without a name
        return None


def listed(value: str | None) -> str:
    return "" if value in (None, "", "(null)", "N/A", "NONE") else str(value)


def partitions(out: str, all_nodes: list[Node]) -> tuple[Partition, ...]:
    """``scontrol -o show partition``, each with its nodes (those whose ``Partitions=`` name it).
    Hidden partitions are left out, as ``sinfo`` leaves them out for users."""
    found = []
    for line in out.splitlines():
        fields = pairs(line)
        name = fields.get("PartitionName")
        if not name or fields.get("Hidden") == "YES":
            continue
        found.append(Partition(
            name=name, nodes=tuple(n for n in all_nodes if name in n.partitions),
            default=fields.get("Default") == "YES",
            max_time_min=minutes(fields.get("MaxTime", "")), default_time_min=minutes(fields.get("DefaultTime", "")),
            def_mem_per_cpu_mb=number(fields.get("DefMemPerCPU")),
            max_mem_per_node_mb=number(fields.get("MaxMemPerNode")),
            max_mem_per_cpu_mb=number(fields.get("MaxMemPerCPU")),
            max_cpus_per_node=number(fields.get("MaxCPUsPerNode")), max_nodes=number(fields.get("MaxNodes")),
            state=fields.get("State", "UP"), qos=listed(fields.get("QoS")),
            allow_qos=fields.get("AllowQos", "ALL" if "DenyQos" not in fields else ""),
            deny_qos=listed(fields.get("DenyQos")),
            allow_accounts=fields.get("AllowAccounts", "ALL" if "DenyAccounts" not in fields else ""),
            deny_accounts=listed(fields.get("DenyAccounts")), allow_groups=fields.get("AllowGroups", "ALL"),
        ))
    return tuple(found)


def mpi_plugins(text: str) -> tuple[str, ...]:
    """``srun --mpi=list`` (stdout and stderr together) in each release's format: 22.05 on
    (``MPI plugin types are...``, a tab before each name, then ``specific pmix plugin versions
    available: pmix_v4,pmix_v5``) and 20.11/21.08 (``srun: MPI types are...``, ``srun: pmix``,
    ``srun: pmix_v3``; older ones ``srun: mpi/pmi2``)."""
    names = []
    for line in text.splitlines():
        m = re.fullmatch(r"(?:srun:)?\s+(?:mpi/)?([\w-]+)\s*", line)
        if m is not None:
            names.append(m[1])
        elif "pmix plugin versions available:" in line:
            names += re.findall(r"pmix_v\d+", line)
    return tuple(dict.fromkeys(names))


def associations(out: str) -> tuple[Association, ...]:
    """``sacctmgr -n -P show assoc ... format=account,partition,qos,defaultqos``."""
    rows = []
    for line in out.splitlines():
        cells = line.split("|")
        if len(cells) >= 4 and cells[0]:
            rows.append(Association(cells[0], cells[1], tuple(q for q in cells[2].split(",") if q), cells[3]))
    return tuple(rows)


def tres(value: str) -> dict[str, str]:
    """A TRES list (``cpu=64,gres/gpu=8,node=4``) by name."""
    found = {}
    for item in value.split(","):
        key, sep, amount = item.partition("=")
        if sep and key.strip():
            found[key.strip()] = amount.strip()
    return found


def qos_rows(out: str) -> dict[str, Qos]:
    """``sacctmgr -n -P show qos format=name,maxwall,maxtresperjob,maxtresperuser,maxjobsperuser,
    maxsubmitjobsperuser`` (or its first two columns alone)."""
    found = {}
    for line in out.splitlines():
        cells = [*line.split("|"), "", "", "", "", ""]
        if not cells[0]:
            continue
        found[cells[0]] = Qos(cells[0], minutes(cells[1]), tres(cells[2]), tres(cells[3]), number(cells[4] or None),
                              number(cells[5] or None))
    return found


def pmix_dir(conf: dict[str, str]) -> str | None:
    for value in (conf.get("PMIxCliTmpDirBase"), conf.get("TmpFS")):
        if value and value != "(null)":
            return re.sub(r"/[^/]*%[a-z][^/]*$", "", value) or "/"  # TmpFS=/tmp/%n: the folder above the node's
    return None


def cluster_from(texts: Texts, user: str, groups: tuple[str, ...] = ()) -> Cluster:
    """The cluster the commands' `texts` describe, as `user` (in `groups`) sees it."""
    conf = config(texts.config)
    all_nodes = (nodes_json(texts.nodes_json) if texts.nodes_json else None) or nodes(texts.nodes)
    accounting = texts.assoc is not None
    qos = qos_rows(texts.qos) if accounting else {}
    default = texts.user.strip().splitlines()[0].strip() if accounting and texts.user.strip() else None
    return Cluster(
        name=conf.get("ClusterName", "slurm"), as_of=as_of(texts.config), version=conf.get("SLURM_VERSION", ""),
        # an unset MpiDefault: 22.05 prints none, 24.11 (null)
        mpi_default=listed(conf.get("MpiDefault")) or "none", mpi_plugins=mpi_plugins(texts.mpi_list),
        select_type=conf.get("SelectType", ""), accounting=accounting, default_account=default or None,
        enforce=conf.get("AccountingStorageEnforce", "none"), max_array_size=number(conf.get("MaxArraySize")) or 1001,
        associations=associations(texts.assoc or ""), qos_max_wall_min={n: q.max_wall_min for n, q in qos.items()},
        qos_limits=qos, pyxis="--container-image" in texts.srun_help, pmix_dir=pmix_dir(conf),
        partitions=partitions(texts.partitions, all_nodes), user=user, groups=groups,
    )

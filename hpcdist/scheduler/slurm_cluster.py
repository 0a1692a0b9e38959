"""What a live Slurm cluster is, read from its own commands: the facts a site config states.

``read_cluster()`` asks the controller (``scontrol show config``, ``show partition``, ``show
node``), ``srun`` (its MPI plugins, whether pyxis adds ``--container-image``) and the accounting
(``sacctmgr``: the user's associations and their QOS limits), each through ``slurm.run`` with
its timeout, into one frozen ``Cluster``. ``config_stamp()`` is the cluster's name and its
controller's "configuration data as of" stamp alone: what a cached reading is checked against;
``node_states()`` is each node's state now (sinfo), ``slurmd_addresses(nodes)`` where their slurmd
listens (what the roll call of ``hpcdist.runtime.rollcall`` probes before it marks a node). What
a command could not answer is recorded as unknown (``accounting=False``, an empty tuple), never guessed; only a
controller that does not answer at all is an error. Standard library only.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from hpcdist.errors import SubmitError
from hpcdist.scheduler import slurm

# ``Key=Value`` pairs of one ``scontrol -o`` line; a value may hold spaces (OS=Linux 6.1 #1 SMP)
_PAIR = re.compile(r"(\w+)=(.*?)(?=\s+\w+=|\s*$)")
_GRES = re.compile(r"gpu(?::(?P<type>[^:(,]+))?:(?P<count>\d+)")
UNLIMITED = None  # a limit Slurm reports as UNLIMITED, INFINITE or NONE


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int = 0
    gpu_type: str | None = None
    features: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    state: str = ""


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[Node, ...]
    default: bool = False
    max_time_min: int | None = UNLIMITED
    default_time_min: int | None = UNLIMITED
    def_mem_per_cpu_mb: int | None = None
    max_mem_per_node_mb: int | None = None
    state: str = "UP"
    allow_qos: str = "ALL"
    allow_accounts: str = "ALL"

    @property
    def gpu_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.gpus)


@dataclass(frozen=True)
class Association:
    """One of the user's associations: an account and the QOS it may use (sacctmgr)."""

    account: str
    partition: str = ""
    qos: tuple[str, ...] = ()
    default_qos: str = ""


@dataclass(frozen=True)
class Cluster:
    name: str
    as_of: str  # the controller's configuration stamp: a change of slurm.conf changes it
    version: str = ""
    mpi_default: str = "none"
    mpi_plugins: tuple[str, ...] = ()
    select_type: str = ""
    accounting: bool = False  # sacctmgr answered for this user
    enforce: str = "none"  # AccountingStorageEnforce
    default_account: str | None = None
    associations: tuple[Association, ...] = ()
    qos_max_wall_min: dict[str, int | None] = field(default_factory=dict)
    pyxis: bool = False
    pmix_dir: str | None = None  # where srun --mpi=pmix keeps its sockets: PMIxCliTmpDirBase, else TmpFS
    partitions: tuple[Partition, ...] = ()
    user: str = ""

    @property
    def gres_gpus(self) -> bool:
        """``--gpus-per-node`` needs select/cons_tres; the older plugins take ``--gres=gpu:N``."""
        return self.select_type != "select/cons_tres"

    @property
    def default_partition(self) -> Partition | None:
        return next((p for p in self.partitions if p.default), self.partitions[0] if self.partitions else None)


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


def _pairs(line: str) -> dict[str, str]:
    return {k: v.strip() for k, v in _PAIR.findall(line)}


def _ask(argv: list[str]) -> slurm.Answer:
    return slurm.run(argv, timeout=min(slurm.timeout_s(), 20.0))


def config_stamp() -> tuple[str, str] | None:
    """The cluster's name and its controller's "Configuration data as of" stamp, or None when it
    does not answer: what tells a cached reading of this cluster from a stale one."""
    answer = _ask(["scontrol", "show", "config"])
    if not answer.ok or not answer.out:
        return None
    conf = _config(answer.out)
    return conf.get("ClusterName", "slurm"), answer.out.splitlines()[0].rpartition(" as of ")[2].strip()


def _config(out: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            conf[key.strip()] = value.strip()
    return conf


def _int(value: str | None) -> int | None:
    try:
        return int(str(value).rstrip("M"))
    except (TypeError, ValueError):
        return None


def _nodes(out: str) -> list[Node]:
    nodes = []
    for line in out.splitlines():
        pairs = _pairs(line)
        if "NodeName" not in pairs:
            continue
        gpus, gpu_type = 0, None
        for item in re.split(r",(?=[a-z])", pairs.get("Gres", "")):
            if (m := _GRES.match(item)) is not None:
                gpus += int(m["count"])
                gpu_type = m["type"] or gpu_type
        features = pairs.get("AvailableFeatures", "")
        nodes.append(Node(
            name=pairs["NodeName"], cpus=_int(pairs.get("CPUTot")) or 1, memory_mb=_int(pairs.get("RealMemory")) or 0,
            gpus=gpus, gpu_type=gpu_type,
            features=tuple(f for f in features.split(",") if f and f != "(null)"),
            partitions=tuple(p for p in pairs.get("Partitions", "").split(",") if p),
            state=pairs.get("State", ""),
        ))
    return nodes


def _partitions(out: str, nodes: list[Node]) -> tuple[Partition, ...]:
    found = []
    for line in out.splitlines():
        pairs = _pairs(line)
        name = pairs.get("PartitionName")
        if not name or pairs.get("Hidden") == "YES":
            continue
        found.append(Partition(
            name=name, nodes=tuple(n for n in nodes if name in n.partitions), default=pairs.get("Default") == "YES",
            max_time_min=minutes(pairs.get("MaxTime", "")), default_time_min=minutes(pairs.get("DefaultTime", "")),
            def_mem_per_cpu_mb=_int(pairs.get("DefMemPerCPU")), max_mem_per_node_mb=_int(pairs.get("MaxMemPerNode")),
            state=pairs.get("State", "UP"), allow_qos=pairs.get("AllowQos", "ALL"),
            allow_accounts=pairs.get("AllowAccounts", "ALL"),
        ))
    return tuple(found)


def _mpi_plugins() -> tuple[str, ...]:
    answer = _ask(["srun", "--mpi=list"])
    text = answer.out + answer.err  # Slurm 22.05 prints the list on stderr
    names = [line.strip() for line in text.splitlines() if re.fullmatch(r"\s+[\w-]+", line)]
    names += re.findall(r"(pmix_v\d+)", text)
    return tuple(dict.fromkeys(n for n in names if n))


def _accounting(user: str) -> tuple[bool, str | None, tuple[Association, ...], dict[str, int | None]]:
    assoc = _ask(["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user}",
                  "format=account,partition,qos,defaultqos"])
    if not assoc.ok:
        return False, None, (), {}
    rows = []
    for line in assoc.out.splitlines():
        cells = line.split("|")
        if len(cells) >= 4 and cells[0]:
            rows.append(Association(cells[0], cells[1], tuple(q for q in cells[2].split(",") if q), cells[3]))
    who = _ask(["sacctmgr", "-n", "-P", "show", "user", user, "format=defaultaccount"])
    default = who.out.strip().splitlines()[0] if who.ok and who.out.strip() else None
    qos = _ask(["sacctmgr", "-n", "-P", "show", "qos", "format=name,maxwall"])
    walls = {}
    for line in qos.out.splitlines() if qos.ok else ():
        name, _, wall = line.partition("|")
        if name:
            walls[name] = minutes(wall)
    return True, default, tuple(rows), walls


def _pmix_dir(conf: dict[str, str]) -> str | None:
    for value in (conf.get("PMIxCliTmpDirBase"), conf.get("TmpFS")):
        if value and value != "(null)":
            return re.sub(r"/[^/]*%[a-z][^/]*$", "", value) or "/"  # TmpFS=/tmp/%n: the folder above the node's
    return None


def read_cluster() -> Cluster:
    """The live cluster `srun` on this PATH talks to (``$SLURM_CONF`` if set), read once."""
    config = _ask(["scontrol", "show", "config"])
    if not config.ok:
        raise SubmitError(f"cannot read the Slurm cluster: {config.why}; is this a login node of it "
                          f"(`scontrol ping` says whether its controller answers)?")
    conf = _config(config.out)
    first = config.out.splitlines()[0] if config.out else ""
    node_answer = _ask(["scontrol", "-o", "show", "node"])
    part_answer = _ask(["scontrol", "-o", "show", "partition"])
    for answer in (node_answer, part_answer):
        if not answer.ok:
            raise SubmitError(f"cannot read the Slurm cluster's nodes and partitions: {answer.why}")
    nodes = _nodes(node_answer.out)
    user = os.environ.get("USER") or getpass.getuser()
    accounting, default_account, associations, walls = (
        _accounting(user) if conf.get("AccountingStorageType", "").endswith("slurmdbd") else (False, None, (), {}))
    helptext = _ask(["srun", "--help"]) if shutil.which("srun") else slurm.Answer(False)
    return Cluster(
        name=conf.get("ClusterName", "slurm"), as_of=first.rpartition(" as of ")[2].strip(),
        version=conf.get("SLURM_VERSION", ""), mpi_default=conf.get("MpiDefault", "none"),
        mpi_plugins=_mpi_plugins(), select_type=conf.get("SelectType", ""), accounting=accounting,
        enforce=conf.get("AccountingStorageEnforce", "none"), default_account=default_account,
        associations=associations, qos_max_wall_min=walls, pyxis="--container-image" in helptext.out,
        pmix_dir=_pmix_dir(conf),
        partitions=_partitions(part_answer.out, nodes), user=user,
    )


SLURMD_PORT = 6818  # Slurm's default SlurmdPort


def slurmd_addresses(nodes: Sequence[str]) -> dict[str, tuple[str, int]]:
    """Where the slurmd of each of `nodes` listens: its NodeAddr and its Port (the node's own, else
    the cluster's SlurmdPort, else Slurm's default), from one ``scontrol show node`` (and at most
    one ``show config``); a node the controller does not list, or all when it does not answer, is
    left out. Every node's slurmd is reachable from the others: Slurm forwards its messages node
    to node."""
    answer = _ask(["scontrol", "-o", "show", "node", ",".join(nodes)]) if nodes else slurm.Answer(False)
    found: dict[str, tuple[str, int]] = {}
    cluster_port: int | None = None
    for line in answer.out.splitlines() if answer.ok else ():
        pairs = _pairs(line)
        name = pairs.get("NodeName", "")
        if name not in nodes:
            continue
        port = _int(pairs.get("Port"))
        if port is None:
            if cluster_port is None:
                config = _ask(["scontrol", "show", "config"])
                cluster_port = (_int(_config(config.out).get("SlurmdPort")) if config.ok else None) or SLURMD_PORT
            port = cluster_port
        found[name] = (pairs.get("NodeAddr") or name, port)
    return found


def test_only(options: list[str]) -> slurm.Answer:
    """``sbatch --test-only`` with `options`: whether Slurm would take such a job (its account,
    QOS, partition), nothing queued."""
    return slurm.run(["sbatch", "--test-only", *options, "--wrap=true"], retry=False)


@dataclass(frozen=True)
class Step:
    code: int | None  # None: no nodes (or no end) within the time given
    out: str = ""
    err: str = ""


def step(options: list[str], command: list[str], timeout_s: float) -> Step:
    """One ``srun`` step of `command` with `options`, waiting at most `timeout_s` for its nodes
    and its end (``hpcdist site check``'s storage test, ``site init --probe``)."""
    try:
        proc = subprocess.run(["srun", *options, *command], capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return Step(None)
    except OSError as exc:
        return Step(127, err=str(exc))
    return Step(proc.returncode, proc.stdout, proc.stderr)


# ---------------------------------------------------------------- the nodes now


@dataclass(frozen=True)
class NodeStatus:
    """One node as sinfo shows it: its partitions, Slurm's state and the reason an admin or
    slurmctld gave for it (``Not responding``, ``Kill task failed``; "" when none)."""

    node: str
    partitions: tuple[str, ...]
    state: str  # sinfo's long form: idle, mixed, allocated, down*, drained, ...
    reason: str = ""

    @property
    def failed(self) -> bool:
        """Not responding (sinfo's ``*``), down or failing: what a node that died looks like."""
        return self.state.endswith("*") or self.state.startswith(("down", "fail"))

    @property
    def dead(self) -> bool:
        """Slurm gave up on it: down, failing or drained. Not one merely slow to answer a ping
        (``mixed*``): a busy node is flagged so for seconds, and is not dead."""
        return self.state.lower().startswith(("down", "drain", "fail"))


def node_states(nodes: str = "", partition: str = "") -> dict[str, NodeStatus] | None:
    """Every node Slurm knows (or those of the host list `nodes`, or of `partition`), by name;
    None when sinfo could not be asked (unknown, not none)."""
    for value in (nodes, partition):
        if value and not re.fullmatch(r"[A-Za-z0-9_.,\[\]-]+", value):
            raise SubmitError(f"{value!r} is not a Slurm host list or partition (n[1-4], n1,n3, cpu)")
    where = ["-n", nodes] if nodes else ["-p", partition] if partition else []
    answer = slurm.run(["sinfo", "-N", "-h", *where, "-o", "%N|%P|%T|%E"])
    if not answer.ok:
        return None
    found: dict[str, NodeStatus] = {}
    for line in answer.out.splitlines():
        parts = line.split("|", 3)
        if len(parts) != 4:
            continue
        name, part, state, reason = (p.strip() for p in parts)
        seen = found.get(name)
        partitions = (*(seen.partitions if seen else ()), part.rstrip("*"))
        found[name] = NodeStatus(name, partitions, state, "" if reason == "none" else reason)
    return found

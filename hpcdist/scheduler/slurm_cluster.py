"""What a live Slurm cluster is, read from its own commands: the facts a site config states.

``read_cluster()`` asks the controller (``scontrol show config``, ``show partition``, ``show
node``: as JSON where the release prints it, ``hpcdist.scheduler.slurm_json``), ``srun`` (its
MPI plugins, whether pyxis adds ``--container-image``) and the accounting
(``sacctmgr``: the user's associations on this cluster and the QOS limits), each through
``slurm.run`` with its timeout, into one frozen ``Cluster``; what their text means is read by
``hpcdist.scheduler.slurm_text``, which the tests feed each release's captured text.
``config_stamp()`` is the cluster's name and its controller's "configuration data as of" stamp
alone: what a cached reading is checked against;
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
from dataclasses import dataclass
from pathlib import Path

from hpcdist.errors import SubmitError
from hpcdist.scheduler import slurm, ssh
from hpcdist.scheduler.slurm_json import node_fields
from hpcdist.scheduler.slurm_now import (  # noqa: F401
    NodeStatus,
    QueuedJob,
    Reservation,
    node_statuses,
    queued_jobs,
    reservations,
)
from hpcdist.scheduler.slurm_text import (  # noqa: F401 (the cluster's facts: slurm_cluster users name them here)
    UNLIMITED,
    Association,
    Cluster,
    Node,
    Partition,
    Qos,
    Texts,
    as_of,
    cluster_from,
    config,
    minutes,
    number,
    pairs,
)


def _ask(argv: list[str]) -> slurm.Answer:
    return slurm.run(argv, timeout=min(slurm.timeout_s(), 20.0))


def config_stamp() -> tuple[str, str] | None:
    """The cluster's name and its controller's "Configuration data as of" stamp, or None when it
    does not answer: what tells a cached reading of this cluster from a stale one."""
    answer = _ask(["scontrol", "show", "config"])
    if not answer.ok or not answer.out:
        return None
    return config(answer.out).get("ClusterName", "slurm"), as_of(answer.out)


def _groups(user: str) -> tuple[str, ...]:
    """The names of `user`'s groups (a partition's AllowGroups names groups)."""
    import grp
    import pwd

    try:
        ids = os.getgrouplist(user, pwd.getpwnam(user).pw_gid)
    except (KeyError, OSError):
        ids = os.getgroups()
    names = []
    for gid in ids:
        try:
            names.append(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return tuple(dict.fromkeys(names))


def _accounting(user: str, cluster: str) -> tuple[str | None, str, str]:
    """The user's associations on `cluster` (a slurmdbd may serve several clusters: another's
    account or QOS is not this one's), default account and the QOS table, as sacctmgr prints them;
    None for the associations when sacctmgr does not answer."""
    assoc = _ask(["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user}", f"cluster={cluster}",
                  "format=account,partition,qos,defaultqos"])
    if not assoc.ok:
        return None, "", ""
    who = _ask(["sacctmgr", "-n", "-P", "show", "user", user, "format=defaultaccount"])
    qos = _ask(["sacctmgr", "-n", "-P", "show", "qos", f"format={QOS_FORMAT}"])
    return assoc.out, who.out if who.ok else "", qos.out if qos.ok else ""


QOS_FORMAT = "name,maxwall,maxtresperjob,maxtresperuser,maxjobsperuser,maxsubmitjobsperuser"


def read_cluster() -> Cluster:
    """The live cluster `srun` on this PATH talks to (``$SLURM_CONF`` if set), read once."""
    answer = _ask(["scontrol", "show", "config"])
    if not answer.ok:
        raise SubmitError(f"cannot read the Slurm cluster: {answer.why}; is this a login node of it "
                          f"(`scontrol ping` says whether its controller answers)?")
    conf = config(answer.out)
    # the form made for programs where the release has it; once: 22.05 answers "unrecognized option"
    as_json = slurm.run(["scontrol", "--json", "show", "node"], retry=False, timeout=min(slurm.timeout_s(), 20.0))
    node_json = as_json.out if as_json.ok and node_fields(as_json.out) else ""
    node_answer = _ask(["scontrol", "-o", "show", "node"]) if not node_json else slurm.Answer(True)
    part_answer = _ask(["scontrol", "-o", "show", "partition"])
    for asked in (node_answer, part_answer):
        if not asked.ok:
            raise SubmitError(f"cannot read the Slurm cluster's nodes and partitions: {asked.why}")
    user = os.environ.get("USER") or getpass.getuser()
    assoc, who, qos = (_accounting(user, conf.get("ClusterName", "slurm"))
                       if conf.get("AccountingStorageType", "").endswith("slurmdbd") else (None, "", ""))
    mpi = _ask(["srun", "--mpi=list"])
    helptext = _ask(["srun", "--help"]) if shutil.which("srun") or ssh.login() else slurm.Answer(False)
    texts = Texts(config=answer.out, nodes=node_answer.out, partitions=part_answer.out,
                  mpi_list=mpi.out + mpi.err,  # Slurm 20.11 to 22.05 print the list on stderr
                  assoc=assoc, user=who, qos=qos, srun_help=helptext.out, nodes_json=node_json)
    return cluster_from(texts, user, _groups(user))


RESERVATIONS_KEPT_S = 60.0  # an Executor's 50 submissions, or 20 `submit` at once, ask once, not 50 times
_reservations: dict[tuple[str, str], tuple[float, list[Reservation]]] = {}


def current_reservations(shared: Path | None = None) -> list[Reservation] | None:
    """The cluster's reservations now (``scontrol -o show reservation``), kept a minute in this
    process and, given `shared` (a file in the user's state folder), for her other processes;
    None when it does not answer."""
    import dataclasses
    import time

    from hpcdist.scheduler import queue_cache

    key, now = (os.environ.get("SLURM_CONF", ""), ssh.login()), time.monotonic()
    if key in _reservations and now - _reservations[key][0] < RESERVATIONS_KEPT_S:
        return _reservations[key][1]
    kept = queue_cache.read(shared, RESERVATIONS_KEPT_S) if shared is not None else None
    try:
        found = None if kept is None else [
            Reservation(row[0], row[1], row[2], row[3], tuple(f for f in row[4].split(",") if f), row[5], row[6],
                        row[7], row[8]) for row in kept[1].values()]
    except (TypeError, IndexError):
        found = None
    if found is None:
        at, answer = time.time(), _ask(["scontrol", "-o", "show", "reservation"])
        if not answer.ok:
            return None
        found = reservations(answer.out)
        if shared is not None:
            rows = [[",".join(v) if isinstance(v, tuple) else str(v) for v in dataclasses.astuple(r)] for r in found]
            queue_cache.write(shared, at, {str(i): row for i, row in enumerate(rows)})
    _reservations[key] = (now, found)
    return found


def my_jobs(user: str) -> list[QueuedJob] | None:
    """`user`'s jobs queued or running now, one per array task (what a QOS's per-user limits
    count); None when squeue does not answer."""
    answer = _ask(["squeue", "-h", "-u", user, "-t", "PD,R", "-r", "-o", "%i|%q|%P|%T|%D|%C|%b|%r"])
    return queued_jobs(answer.out) if answer.ok else None


SLURMD_PORT = 6818  # Slurm's default SlurmdPort


def slurmd_silent(address: tuple[str, int], timeout_s: float) -> str:
    """"its slurmd at ADDR:PORT does not answer" when a TCP connect there got no reply within
    `timeout_s` or the network says the host is unreachable; "" when it connected or was refused
    (a live kernel), or failed otherwise (no evidence either way)."""
    import errno
    import socket

    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError as exc:
        if isinstance(exc, TimeoutError) or exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            return f"its slurmd at {address[0]}:{address[1]} does not answer ({exc.strerror or 'no reply'})"
    return ""


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
        fields = pairs(line)
        name = fields.get("NodeName", "")
        if name not in nodes:
            continue
        port = number(fields.get("Port"))
        if port is None:
            if cluster_port is None:
                conf = _ask(["scontrol", "show", "config"])
                cluster_port = (number(config(conf.out).get("SlurmdPort")) if conf.ok else None) or SLURMD_PORT
            port = cluster_port
        found[name] = (fields.get("NodeAddr") or name, port)
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
        proc = subprocess.run(ssh.argv_for(["srun", *options, *command]), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return Step(None)
    except OSError as exc:
        return Step(127, err=str(exc))
    return Step(proc.returncode, proc.stdout, proc.stderr)


# ---------------------------------------------------------------- the nodes now


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
    return node_statuses(answer.out)

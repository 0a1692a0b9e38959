"""What Slurm says of the moment, read from text (``hpcdist.scheduler.slurm_text`` reads what the
cluster is): each node's state as sinfo shows it, the reservations ``scontrol -o show
reservation`` prints and who may use them, and the user's own jobs as squeue shows them. Pure
functions of text; ``hpcdist.scheduler.slurm_cluster`` runs the commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from hpcdist.scheduler.slurm_text import listed, pairs


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


def node_statuses(out: str) -> dict[str, NodeStatus]:
    """``sinfo -N -h -o '%N|%P|%T|%E'``: each node once, with every partition it is in."""
    found: dict[str, NodeStatus] = {}
    for line in out.splitlines():
        parts = line.split("|", 3)
        if len(parts) != 4:
            continue
        name, part, state, reason = (p.strip() for p in parts)
        seen = found.get(name)
        partitions = (*(seen.partitions if seen else ()), part.rstrip("*"))
        found[name] = NodeStatus(name, partitions, state, "" if reason == "none" else reason)
    return found


@dataclass(frozen=True)
class Reservation:
    """One reservation as ``scontrol -o show reservation`` prints it."""

    name: str
    start: str
    end: str
    nodes: str  # a host list (c[1-2]), as Slurm writes it
    flags: tuple[str, ...] = ()
    partition: str = ""
    state: str = ""  # ACTIVE or INACTIVE (not begun)
    accounts: str = ""
    users: str = ""

    def line(self) -> str:
        """The reservation as a user should hear of it, in Slurm's words."""
        flags = f" (Flags={','.join(self.flags)})" if self.flags else ""
        when = f"until {self.end}" if self.state == "ACTIVE" else f"from {self.start} to {self.end}"
        return f"reservation {self.name!r}{flags} holds {self.nodes} {when}"


def reservations(out: str) -> list[Reservation]:
    """``scontrol -o show reservation`` (``No reservations in the system`` when none)."""
    found = []
    for line in out.splitlines():
        fields = pairs(line)
        if "ReservationName" not in fields:
            continue
        found.append(Reservation(
            name=fields["ReservationName"], start=fields.get("StartTime", ""), end=fields.get("EndTime", ""),
            nodes=fields.get("Nodes", ""), flags=tuple(f for f in fields.get("Flags", "").split(",") if f),
            partition=listed(fields.get("PartitionName")), state=fields.get("State", ""),
            accounts=listed(fields.get("Accounts")), users=listed(fields.get("Users")),
        ))
    return found


def when(stamp: str) -> datetime | None:
    """A time as Slurm prints it (``2025-06-02T18:00:00``, the controller's local time); None for
    ``Unknown``, ``None`` or nothing."""
    try:
        return datetime.fromisoformat(stamp)
    except ValueError:
        return None


def may_use(reservation: Reservation, user: str, account: str | None) -> bool:
    """Whether `user` (charging `account`) is one of `reservation`'s Users or Accounts; a name
    with ``-`` before it is one Slurm keeps out."""
    users, accounts = _names(reservation.users), _names(reservation.accounts)
    if f"-{user}" in users or (account and f"-{account}" in accounts):
        return False
    if user in users or (account and account in accounts):
        return True
    denies_only = all(n.startswith("-") for n in users + accounts) and bool(users + accounts)
    return denies_only


def _names(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


@dataclass(frozen=True)
class QueuedJob:
    """One of the user's jobs (one task of an array) as ``squeue -r -o '%i|%q|%P|%T|%D|%C|%b|%r'``
    prints it: what a QOS's per-user limits count."""

    job_id: str
    qos: str
    partition: str
    state: str  # PENDING, RUNNING
    nodes: int
    cpus: int
    gpus: int  # of all its nodes
    reason: str = ""

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"


def queued_jobs(out: str) -> list[QueuedJob]:
    """``squeue -h -u USER -t PD,R -r -o '%i|%q|%P|%T|%D|%C|%b|%r'``: `%b` is the GPUs of each node
    (24.11 ``gres/gpu:a100:2``, older releases ``gpu:2``; ``N/A`` for none)."""
    found = []
    for line in out.splitlines():
        cells = line.split("|")
        if len(cells) < 8 or not cells[4].isdigit():
            continue
        nodes = int(cells[4])
        per_node = sum(int(m) for m in re.findall(r"(?:^|,)(?:gres[/:])?gpu(?::[^:,(]+)?:(\d+)", cells[6]))
        found.append(QueuedJob(cells[0], listed(cells[1]), cells[2], cells[3], nodes, int(cells[5] or 0),
                               per_node * nodes, cells[7]))
    return found

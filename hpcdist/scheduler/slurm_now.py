"""What Slurm says of the moment, read from text (``hpcdist.scheduler.slurm_text`` reads what the
cluster is): each node's state as sinfo shows it, and the reservations ``scontrol -o show
reservation`` prints. Pure functions of text; ``hpcdist.scheduler.slurm_cluster`` runs the commands.
"""

from __future__ import annotations

from dataclasses import dataclass

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

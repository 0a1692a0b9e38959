"""What the in-job supervisor (``hpcdist.runtime.in_job``) makes of faults: which of the job's
nodes it takes out (the dead ones, by Slurm's word or a slurmd that does not answer, and the live
ones whose ranks keep dying), and how many restarts in place it may still take.

- **A controller that does not answer** (slurmctld restarting, or failing over) is asked again for
  up to ``CONTROLLER_WAIT_S``: its silence is no sign that every node lives. Past that, the nodes
  are judged by their slurmds alone, at the addresses Slurm gave when the job began.
- **Repeated faults.** A node whose ranks die by a signal twice within ``REPEAT_S`` (a GPU's Xid,
  ECC errors, the OOM killer on a node short of memory) will do it again: while a spare is live,
  it is treated as dead (marked with why, its ranks moved) instead of being given a third try.
  The peers of a hung rank, which ended themselves (``HUNG_EXIT``), are not counted against
  their nodes.
- **The restart budget is a rate** (``preemption.in_job_restarts_per_hour``), not a lifetime
  count: a two-week job with a fault a day never runs out, a job that faults every minute ends.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Mapping, Sequence

HOUR_S = 3600.0  # the window of preemption.in_job_restarts_per_hour
CONTROLLER_WAIT_S = 60.0  # how long a check of the nodes asks a controller that does not answer again
REPEAT_S = 1800.0  # a node whose ranks die by a signal twice within this is moved to a spare


def dead(nodes: Sequence[str], slurmds: dict[str, tuple[str, int]]) -> dict[str, str]:
    """Those of `nodes` that are dead, each with its evidence (Slurm's word, or a slurmd that does
    not answer; `slurmds`: their addresses as Slurm gave them when the job began)."""
    from hpcdist.runtime.rollcall import evidence
    from hpcdist.scheduler import slurm_cluster

    deadline = time.monotonic() + CONTROLLER_WAIT_S
    known = slurm_cluster.node_states()
    if known is None:
        _say(f"in-job: the Slurm controller does not answer; asking again for up to {CONTROLLER_WAIT_S:g} s "
             f"before judging {','.join(nodes)}")
    while known is None and time.monotonic() < deadline:
        time.sleep(2.0)
        known = slurm_cluster.node_states()
    if known is None:
        _say("in-job: the Slurm controller still does not answer: the nodes are judged by their slurmds alone")
    asked = [n for n in nodes if known is None or n in known]
    return {node: why for node, why in evidence(asked, known or {}, slurmds).items() if why}


class Faults:
    """When each live node's ranks died by a signal (``REPEAT_S`` back)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {}

    def repeated(self, faulty: Mapping[str, str]) -> dict[str, str]:
        """Of the nodes in `faulty` (node: how its rank died), noted now, those whose ranks died
        for the second time within ``REPEAT_S``, each with why."""
        now = time.monotonic()
        found: dict[str, str] = {}
        for node, how in faulty.items():
            self.seen[node] = [t for t in self.seen.get(node, []) if now - t < REPEAT_S] + [now]
            if len(self.seen[node]) >= 2:
                found[node] = (f"its ranks died by a signal {len(self.seen[node])} times within {REPEAT_S / 60:g} "
                               f"min (the last: {how})")
        return found

    def repeats(self, node: str) -> bool:
        return len(self.seen.get(node, [])) >= 2


class Budget:
    """The in-place restarts taken in the last hour, against ``per_hour``."""

    def __init__(self, per_hour: int) -> None:
        self.per_hour, self.taken = per_hour, 0
        self.at: list[float] = []

    def allows(self) -> bool:
        now = time.monotonic()
        self.at = [t for t in self.at if now - t < HOUR_S]
        return len(self.at) < self.per_hour

    def take(self) -> None:
        self.taken += 1
        self.at.append(time.monotonic())

    def line(self) -> str:
        return (f"in-place restart {self.taken}; {len(self.at)} of the {self.per_hour} an hour that the site's "
                f"preemption.in_job_restarts_per_hour allows")


def node_addresses(nodes: Sequence[str], slurmds: dict[str, tuple[str, int]]) -> set[str]:
    """The IPv4 addresses of `nodes`: what their names and the NodeAddr Slurm gives for them
    resolve to (from this node), those the supervisor takes connections from first."""
    found: set[str] = set()
    for name in {*nodes, *(addr for addr, _ in slurmds.values())}:
        try:
            found |= {str(info[4][0]) for info in socket.getaddrinfo(name, None, socket.AF_INET)}
        except OSError:
            continue
    return found


def _say(line: str) -> None:
    print(f"hpcdist: {line}", file=sys.stderr, flush=True)

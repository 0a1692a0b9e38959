"""Rank facts from a launcher's environment: one table per launcher, read by one function.

Launcher detection is data, not code (as submitit's ``SlurmJobEnvironment._env``): each table
(kept with its launcher in ``hpcdist.launchers``) maps a field to the variables that may carry
it, first present wins. ``RankInfo.from_env`` takes
the environment as an argument so tests pass a dict.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from hpcdist.config.contract import array_task_id
from hpcdist.errors import BootstrapError
from hpcdist.launchers import EnvTable, env_tables
from hpcdist.scheduler.hostlist import expand_hostlist, expand_tasks_per_node


def table(name: str) -> EnvTable:
    """The environment table named `name` (KeyError if none is)."""
    return {t.name: t for t in env_tables()}[name]


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in the job."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    hosts: tuple[str, ...] = ()
    hostname: str = field(default_factory=socket.gethostname)  # Slurm's node name when there is one
    job_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def agent_store(self) -> bool:
        """Whether the launcher's agent serves the rendezvous store (torchrun), not rank 0."""
        return table(self.launcher).agent_store

    @classmethod
    def detect_launcher(cls, env: Mapping[str, str]) -> str:
        """The name of the first environment table whose detecting variables are all set."""
        return next(t.name for t in env_tables() if all(v in env for v in t.detect))

    @classmethod
    def from_env(cls, env: Mapping[str, str], hostname: str | None = None) -> RankInfo:
        """Rank facts for the launcher detected in `env`; inconsistencies are BootstrapErrors."""
        launcher = cls.detect_launcher(env)
        fields = table(launcher).fields

        def raw(name: str) -> str | None:
            for var in fields.get(name, ()):
                if env.get(var, "") != "":
                    return env[var]
            return None

        def number(name: str, default: int | None) -> int | None:
            value = raw(name)
            if value is None:
                return default
            try:
                return int(value)
            except ValueError:
                var = next(v for v in fields[name] if env.get(v, "") != "")
                raise BootstrapError(
                    f"{launcher} launch: {var}={value!r} is not an integer; "
                    f"check the launcher's environment"
                ) from None

        rank = number("rank", 0)
        world = number("world_size", 1)
        assert rank is not None and world is not None
        if world < 1 or not 0 <= rank < world:
            raise BootstrapError(
                f"{launcher} launch: rank {rank} is outside world size {world}; "
                f"the launcher's environment is inconsistent"
            )
        hosts = tuple(expand_hostlist(raw("nodelist") or ""))
        name = hostname or env.get("SLURMD_NODENAME") or socket.gethostname()
        per_node = _tasks_per_node(raw("tasks_per_node"), launcher)
        local_world = number("local_world_size", None)
        node_rank = number("node_rank", None)
        if node_rank is None:
            if name in hosts:  # the launcher names no node index: this host's place in the node list
                node_rank = hosts.index(name)
            elif per_node:
                node_rank = _node_of(rank, per_node)
            else:  # block placement, as the launch lines ask for; exact once ranks check in
                node_rank = rank // local_world if local_world else 0
        num_nodes = number("num_nodes", None) or len(hosts) or len(per_node) or (
            -(-world // local_world) if local_world else 1
        )
        if local_world is None:
            local_world = per_node[node_rank] if node_rank < len(per_node) else world // num_nodes
        local_rank = number("local_rank", None)
        if local_rank is None:
            local_rank = rank - sum(per_node[:node_rank]) if per_node else rank % max(local_world, 1)
        if not 0 <= local_rank < max(local_world, 1):
            raise BootstrapError(
                f"{launcher} launch: local rank {local_rank} is outside the {local_world} ranks "
                f"on this node"
            )
        port = number("master_port", None)
        return cls(
            launcher=launcher,
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=max(local_world, 1),
            node_rank=node_rank,
            num_nodes=num_nodes,
            hosts=hosts,
            hostname=name,
            job_id=array_task_id(env) or raw("job_id"),  # submitit's name of an array task
            master_addr=raw("master_addr"),
            master_port=port,
        )

    @property
    def single_host(self) -> bool:
        """Whether every rank runs on this host (then the ranks meet on loopback)."""
        return self.local_world_size >= self.world_size

    def placed(self, host_of_rank: Mapping[int, str]) -> RankInfo:
        """These facts with the node index and count taken from every rank's host, as the
        rendezvous gathered them, for launchers that name no node index (Open MPI, MPICH, env://).

        Nodes are numbered in the order of their lowest rank.
        """
        if "node_rank" in table(self.launcher).fields:
            return self
        nodes = list(dict.fromkeys(host_of_rank[r] for r in sorted(host_of_rank)))
        if self.hostname not in nodes:
            return self
        return replace(self, node_rank=nodes.index(self.hostname), num_nodes=len(nodes))

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.num_nodes}) on {self.hostname} via {self.launcher}"
        )


def _tasks_per_node(text: str | None, launcher: str) -> list[int]:
    if not text:
        return []
    try:
        return expand_tasks_per_node(text)
    except ValueError as exc:
        raise BootstrapError(f"{launcher} launch: {exc}") from None


def _node_of(rank: int, per_node: list[int]) -> int:
    """The node holding `rank` under Slurm's default block distribution."""
    total = 0
    for node, count in enumerate(per_node):
        total += count
        if rank < total:
            return node
    return len(per_node) - 1

"""Launchers by name: how a job script starts one process per rank, and what each rank then sees.

One class per launcher, registered by name (ReFrame's ``@register_launcher``); a duplicate name
is an error. A launcher owns everything that differs between launchers:

- ``schedulers``: the site schedulers it works under (``launcher.kind`` is checked against it);
- ``command(plan)``: its launch line in the job script (or, for ``local``, the command
  submitit's LocalExecutor runs per rank);
- ``env_tables``: the variables its ranks carry, one table per flavour (``RankInfo.from_env``
  reads them; detection is data, not code; env:// and a lone process have tables of their own);
- ``task_env(info)``: what the rank must fix before submitit's task runner starts (``hpcdist.runtime.task_ids``);
  srun sets Slurm's per-task variables itself, mpirun and torchrun do not;
- ``prelude(plan)``: shell lines the script runs on the batch host (the first node) before
  the launch line (torchrun: the head node's address on ``network.socket_ifname``).

Signals: the site's preemption signal (``--signal=SIG@N``, not ``B:``) goes to every process
of every job step (proctrack/linuxproc and proctrack/cgroup signal the whole step), so the
ranks get it wherever they run, and submitit's handler (``SUBMITIT_PREEMPTION_SIGNAL``) or a
job's ``Context.should_stop`` flag takes it. A process between Slurm and the ranks must survive it:
torchrun's agent would die of it (it handles only SIGTERM, SIGINT, SIGHUP and SIGQUIT), so it
runs under ``hpcdist.runtime.agent``, which lets the agent outlive the signal its workers act on.
mpirun runs in the batch step, which Slurm leaves out, and so would its ranks on the first node:
it asks for the signal on the batch shell (``--signal=B:SIG@N``, ``signal_flag``), which hands it
to mpirun, and mpirun forwards SIGUSR1/SIGUSR2 to every rank. SIGTERM, which Slurm sends to every
process of a job it preempts, requeues or cancels (``KillWait`` seconds before SIGKILL), needs no
flag: under srun each rank gets it from its step and sets the same stop flag
(``hpcdist.runtime.requeue``), and Slurm, not the job, decides whether it comes back.

Cheap on purpose (standard library only): the login node renders with it, the nodes detect
ranks with it.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar


class RankInfo(Protocol):
    """The rank facts a launcher's environment table is written from (``runtime.rankinfo.RankInfo``
    has them; launchers stand below the runtime and do not import it)."""

    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def node_rank(self) -> int: ...

# Python's -P (3.11+; PYTHONSAFEPATH): no folder first on sys.path, neither the working folder
# (`-m`, `-c`) nor a script's. Every Python hpcdist starts has it: the submit folder may be one that
# others write (a group's project folder), and a json.py or hpcdist/ put there would run as the user
# on the login node and on every rank, before any check. The user's code comes from its snapshot,
# put first by hpcdist.kinds.python. A Python 3.10 has no -P (docs/shared-sites.md).
SAFE_PATH: tuple[str, ...] = ("-P",) if sys.version_info >= (3, 11) else ()

# The module each rank runs: submitit's task runner, or task_ids, which fixes its variables first.
SUBMITIT_RUNNER = "hpcdist.runtime.task_runner"  # submitit's task runner, behind the trust check
TASK_IDS = "hpcdist.runtime.task_ids"
AGENT = "hpcdist.runtime.agent"  # torchrun's agent, kept alive through the preemption signal


@dataclass(frozen=True)
class EnvTable:
    """Which variables carry each rank fact under one launcher; first present wins.

    Fields: rank, world_size, local_rank, local_world_size, node_rank, num_nodes, nodelist,
    tasks_per_node, job_id, master_addr, master_port. ``detect`` lists the variables whose
    presence identifies the table; ``priority`` orders detection (lower first), because a
    launcher started inside another keeps the outer one's variables (MPI under srun still has
    SLURM_PROCID). ``agent_store``: the launcher's agent already serves the TCPStore at
    master_addr:master_port, so every rank is a client.
    """

    name: str
    detect: tuple[str, ...]
    fields: Mapping[str, tuple[str, ...]]
    priority: int
    agent_store: bool = False


# Slurm's job-wide variables: fallbacks for the ranks of any launcher started inside an allocation.
SLURM_FALLBACK: dict[str, tuple[str, ...]] = {
    "node_rank": ("SLURM_NODEID",),
    "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
}
_SLURM_BUT_NODE = {k: v for k, v in SLURM_FALLBACK.items() if k != "node_rank"}
# Job-wide only: a rank that Open MPI starts on another node inherits its daemon's srun step (one
# node, one task), so the step's node list and counts, and SLURM_NODEID, describe the daemon.
_SLURM_JOB_ONLY: dict[str, tuple[str, ...]] = {
    "num_nodes": ("SLURM_JOB_NUM_NODES",),
    "nodelist": ("SLURM_JOB_NODELIST",),
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
}

# Tables no site launcher owns: torch's env:// convention set by hand or by another tool, and a
# process started on its own (rank 0 of 1).
UNOWNED_TABLES = (
    EnvTable("env", ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), {
        "rank": ("RANK",),
        "world_size": ("WORLD_SIZE",),
        "local_rank": ("LOCAL_RANK",),
        "local_world_size": ("LOCAL_WORLD_SIZE",),
        "master_addr": ("MASTER_ADDR",),
        "master_port": ("MASTER_PORT",),
        **SLURM_FALLBACK,
    }, priority=20),
    EnvTable("single", (), {}, priority=99),
)


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch line is made of; every piece is quoted by the launcher that uses it."""

    python: str
    folder: Path  # submitit's folder for this job (``%j`` is the job id)
    tasks_per_node: int
    stdout: str  # per-task log patterns (``%j`` job id, ``%t`` task), for srun's own I/O
    stderr: str
    args: tuple[str, ...] = ()  # the site's launcher.args for this launcher's kind
    cpus_per_task: int = 1
    socket_ifname: str | None = None  # the site's network.socket_ifname
    signal: str = "USR2"  # the site's preemption signal
    # A container (``hpcdist.containers``): words before the image's Python, srun's own options
    # (pyxis), and the image's Python; ``python`` stays the host's, for the lines run outside.
    container: tuple[str, ...] = ()
    srun_container: tuple[str, ...] = ()
    rank_python: str | None = None

    def host(self) -> str:
        """What starts the host's Python for the script's own steps (``SAFE_PATH``'s flag after it)."""
        return " ".join([shlex.quote(self.python), *SAFE_PATH])

    def worker(self) -> str:
        """The Python a rank runs in (the image's, in a container), with ``SAFE_PATH``'s flag."""
        return " ".join([shlex.quote(self.rank_python or self.python), *SAFE_PATH])

    def rank(self) -> str:
        """What starts a rank's Python: the host's, or the image's behind the runtime's words."""
        return " ".join([*self.container, self.worker()])


class Launcher:
    """Base of every launcher; subclasses set the class attributes and ``command``."""

    name: ClassVar[str]
    schedulers: ClassVar[tuple[str, ...]] = ("slurm",)
    env_tables: ClassVar[tuple[EnvTable, ...]] = ()

    def command(self, plan: LaunchPlan) -> str:
        """The shell line(s) that start one process per rank (pieces quoted here)."""
        raise NotImplementedError

    def prelude(self, plan: LaunchPlan) -> list[str]:
        """Shell lines run on the batch host before the launch line; none by default."""
        return []

    def signal_flag(self, signal: str, seconds: int) -> str:
        """The value of ``#SBATCH --signal``: by default to every job step, not the batch shell."""
        return f"{signal}@{seconds}"

    def task_env(self, info: RankInfo) -> dict[str, str]:
        """Variables a rank sets before submitit's task runner starts; none by default."""
        return {}


L = TypeVar("L", bound=type[Launcher])
_LAUNCHERS: dict[str, Launcher] = {}


def register_launcher(name: str) -> Callable[[L], L]:
    """Class decorator: register one instance of the launcher under `name`; twice is an error."""

    def deco(cls: L) -> L:
        if name in _LAUNCHERS:
            raise ValueError(
                f"launcher {name!r} is registered twice ({type(_LAUNCHERS[name]).__name__}, {cls.__name__})"
            )
        clash = {t.name for t in env_tables()} & {t.name for t in cls.env_tables}
        if clash:
            raise ValueError(f"launcher {name!r}: environment table(s) {sorted(clash)} already belong to another")
        cls.name = name
        _LAUNCHERS[name] = cls()
        return cls

    return deco


def get_launcher(name: str) -> Launcher:
    """The launcher registered as `name` (KeyError if none is)."""
    return _LAUNCHERS[name]


def launcher_names(scheduler: str | None = None) -> list[str]:
    """Registered names, in registration order; only those for `scheduler` when given."""
    return [n for n, la in _LAUNCHERS.items() if scheduler is None or scheduler in la.schedulers]


def env_tables() -> list[EnvTable]:
    """Every environment table, the launchers' and the unowned ones, in detection order."""
    owned = [t for la in _LAUNCHERS.values() for t in la.env_tables]
    return sorted([*owned, *UNOWNED_TABLES], key=lambda t: t.priority)


def owner_of(table: str) -> Launcher | None:
    """The launcher whose environment table is named `table`, if any."""
    return next((la for la in _LAUNCHERS.values() if any(t.name == table for t in la.env_tables)), None)


def slurm_task_env(info: RankInfo) -> dict[str, str]:
    """Slurm's per-task variables from a rank's facts: submitit names each task's result by them."""
    return {
        "SLURM_PROCID": str(info.rank),
        "SLURM_LOCALID": str(info.local_rank),
        "SLURM_NTASKS": str(info.world_size),
        "SLURM_NODEID": str(info.node_rank),
    }


def _q(items: tuple[str, ...]) -> list[str]:
    return [shlex.quote(a) for a in items]


def _srun_io(plan: LaunchPlan) -> list[str]:
    """srun writes each task's output to submitit's per-task log files."""
    return ["--unbuffered", "--output", shlex.quote(plan.stdout), "--error", shlex.quote(plan.stderr)]


@register_launcher("srun")
class SrunLauncher(Launcher):
    """Slurm's own launcher: it sets every per-task variable and delivers signals to its tasks."""

    env_tables = (
        EnvTable("pmix", ("PMIX_RANK",), {  # srun --mpi=pmix: PMIx gives the rank, Slurm the rest
            "rank": ("PMIX_RANK",),
            "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
            "local_rank": ("SLURM_LOCALID",),
            **SLURM_FALLBACK,
        }, priority=40),
        EnvTable("slurm", ("SLURM_PROCID",), {
            "rank": ("SLURM_PROCID",),
            "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
            "local_rank": ("SLURM_LOCALID",),
            **SLURM_FALLBACK,
        }, priority=41),
    )

    def command(self, plan: LaunchPlan) -> str:
        # srun does not inherit the allocation's --cpus-per-task (Slurm >= 22.05): without it each
        # task gets one CPU, its threads, NCCL's proxy and the checkpoint writers on one core
        cpus = [f"--cpus-per-task={plan.cpus_per_task}"] if plan.cpus_per_task > 1 else []
        return " ".join(["srun", *_srun_io(plan), *cpus, *plan.srun_container, *_q(plan.args), plan.rank(),
                         f"-u -m {SUBMITIT_RUNNER}", shlex.quote(str(plan.folder))])


@register_launcher("mpirun")
class MpirunLauncher(Launcher):
    """An MPI's own launcher (Open MPI, MPICH, Intel MPI); every rank of a node inherits the
    batch step's SLURM_PROCID, so task_ids rewrites Slurm's task variables from the MPI ones.

    Open MPI names no node index (OMPI_COMM_WORLD_NODE_RANK is the rank within the node), so
    the node comes from the hosts: this host's place in the job's node list, else the block
    placement the launch line asks for, and exactly from every rank's host once they check in."""

    env_tables = (
        EnvTable("openmpi", ("OMPI_COMM_WORLD_RANK",), {
            "rank": ("OMPI_COMM_WORLD_RANK",),
            "world_size": ("OMPI_COMM_WORLD_SIZE",),
            "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
            "local_world_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",),
            **_SLURM_JOB_ONLY,
        }, priority=30),
        EnvTable("mpich", ("PMI_RANK",), {  # MPICH's Hydra and Intel MPI
            "rank": ("PMI_RANK",),
            "world_size": ("PMI_SIZE",),
            "local_rank": ("MPI_LOCALRANKID",),
            "local_world_size": ("MPI_LOCALNRANKS",),
            **SLURM_FALLBACK,
        }, priority=31),
    )

    def signal_flag(self, signal: str, seconds: int) -> str:
        return f"B:{signal}@{seconds}"  # the batch shell, which forwards it to mpirun (command)

    def command(self, plan: LaunchPlan) -> str:
        mpirun = " ".join(['mpirun -np "$SLURM_NTASKS"', f"--map-by ppr:{plan.tasks_per_node}:node",
                           *_q(plan.args), plan.rank(), f"-u -m {TASK_IDS}", shlex.quote(str(plan.folder))])
        sig = shlex.quote(plan.signal)
        return "\n".join([  # wait again after each forwarded signal, until mpirun has ended
            f"{mpirun} &",
            "HPCDIST_LAUNCHER_PID=$!",
            f"trap 'kill -{sig} \"$HPCDIST_LAUNCHER_PID\"' {sig}",
            'until wait "$HPCDIST_LAUNCHER_PID"; HPCDIST_STATUS=$?; '
            '! kill -0 "$HPCDIST_LAUNCHER_PID" 2>/dev/null; do :; done',
            'exit "$HPCDIST_STATUS"',
        ])

    def task_env(self, info: RankInfo) -> dict[str, str]:
        return slurm_task_env(info)


@register_launcher("torchrun")
class TorchrunLauncher(Launcher):
    """One srun task per node runs torchrun's agent (under ``hpcdist.runtime.agent``, which
    keeps it alive through the preemption signal), which starts the node's ranks; the head
    node's agent serves the c10d rendezvous at the address the batch host (the head node) has on
    ``network.socket_ifname``, on a port chosen free there for this job, and only that agent
    serves it (``is_host`` from ``SLURM_NODEID``, ``hpcdist.runtime.agent``), so a port taken
    meanwhile is an error, never another job's store. The step asks for one task per
    node explicitly: it would otherwise inherit the job's task count, and srun ignores a lone
    ``--ntasks-per-node=1`` that disagrees with it. task_ids rewrites Slurm's task variables."""

    env_tables = (
        EnvTable("torchrun", ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"), {
            "rank": ("RANK",),
            "world_size": ("WORLD_SIZE",),
            "local_rank": ("LOCAL_RANK",),
            "local_world_size": ("LOCAL_WORLD_SIZE",),
            "node_rank": ("GROUP_RANK",),
            "master_addr": ("MASTER_ADDR",),
            "master_port": ("MASTER_PORT",),
            **_SLURM_BUT_NODE,
        }, priority=10, agent_store=True),
    )
    def prelude(self, plan: LaunchPlan) -> list[str]:
        """The head node's address and a port free on it for this job's c10d store (a fixed port,
        torchrun's 29400, would put two jobs with the same head node on one store).

        With no ``network.socket_ifname``, the address is the one Slurm reaches the head node by,
        its ``NodeAddr`` (sinfo's ``%o``, a field of its own on every release; one line per
        partition of the node): a node's name need not resolve (``NodeName=t1 NodeHostname=vm
        NodeAddr=127.0.0.1``), and then torchrun's agents waited their whole timeout on it."""
        agent = f"{plan.host()} -m {AGENT}"
        port = [f"HPCDIST_RDZV_PORT=$({agent} --free-port) || exit 1", "export HPCDIST_HEAD_ADDR HPCDIST_RDZV_PORT"]
        if plan.socket_ifname is not None:
            return [f"HPCDIST_HEAD_ADDR=$({agent} --address {shlex.quote(plan.socket_ifname)}) || exit 1", *port]
        return ['HPCDIST_HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) || exit 1',
                'HPCDIST_HEAD_ADDR=$(sinfo -h -N -n "$HPCDIST_HEAD_NODE" -o %o | head -n 1)',
                ': "${HPCDIST_HEAD_ADDR:=$HPCDIST_HEAD_NODE}"', *port]

    def command(self, plan: LaunchPlan) -> str:
        ifname = ["--ifname", shlex.quote(plan.socket_ifname)] if plan.socket_ifname else []
        return " ".join([
            "srun", *_srun_io(plan), '--ntasks="$SLURM_JOB_NUM_NODES"', "--ntasks-per-node=1",
            f"--cpus-per-task={plan.cpus_per_task * plan.tasks_per_node}", *plan.srun_container, plan.rank(),
            f"-m {AGENT}",
            *ifname,
            '--nnodes="$SLURM_JOB_NUM_NODES"', f"--nproc-per-node={plan.tasks_per_node}", "--rdzv-backend=c10d",
            '--rdzv-endpoint="$HPCDIST_HEAD_ADDR:$HPCDIST_RDZV_PORT"', '--rdzv-id="$SLURM_JOB_ID"', *_q(plan.args),
            # torchrun starts `python -u -m TASK_IDS`, the working folder first: the worker's Python named instead
            f"--no-python {plan.worker()} -u -m {TASK_IDS}", shlex.quote(str(plan.folder)),
        ])

    def task_env(self, info: RankInfo) -> dict[str, str]:
        return slurm_task_env(info)


@register_launcher("local")
class LocalLauncher(Launcher):
    """No scheduler: submitit's LocalExecutor starts the ranks as processes on this machine and
    sets its own variables; it sends them SIGUSR2/SIGTERM itself on a time-out."""

    schedulers = ("local",)
    env_tables = (
        EnvTable("submitit-local", ("SUBMITIT_LOCAL_JOB_ID",), {
            "rank": ("SUBMITIT_LOCAL_GLOBALID",),
            "world_size": ("SUBMITIT_LOCAL_NTASKS",),
            "local_rank": ("SUBMITIT_LOCAL_LOCALID",),
            "node_rank": ("SUBMITIT_LOCAL_NODEID",),
            "num_nodes": ("SUBMITIT_LOCAL_JOB_NUM_NODES",),
            "job_id": ("SUBMITIT_LOCAL_JOB_ID",),
        }, priority=50),
    )

    def command(self, plan: LaunchPlan) -> str:
        return f"{plan.host()} -u -m {SUBMITIT_RUNNER} {shlex.quote(str(plan.folder))}"

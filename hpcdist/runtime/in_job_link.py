"""The connection between each rank of a job with spare nodes and its in-job supervisor
(``hpcdist.runtime.in_job``): both ends of one line protocol. A rank says ``STEP RANK NODE`` as it
starts, ``failed own|comm RESTART`` when its job raised, ``done`` when it succeeded; the
supervisor answers ``again N``, ``stop``, or ``kill`` (a hung rank ends itself).

- **Sign of life.** The task runner connects to the supervisor as it starts (``report_in``) and
  says who it is; the connection stays open, unread, for the process's life, and its kernel
  answers the supervisor's keepalives.
- **In-place restart.** When a rank's process dies on a node that lives (killed, the OOM killer,
  a segfault), the other ranks are not started again: their job raises (a collective's peer is
  gone), and the task runner asks the supervisor (``again``), which answers with the next restart
  number. The rank then runs the job again in the same process (``IN_JOB_RESTART_VAR`` set: a
  new rendezvous, a new process group, the resume from the last checkpoint), with torch and the
  job's modules already imported. Only the dead rank gets a new process: a step of its own on
  its node, which takes the rank it replaces (``adopt``, from ``IN_PLACE_VAR``).
"""

from __future__ import annotations

import os
import queue
import re
import selectors
import signal
import socket
import sys
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from hpcdist.config.contract import IN_PLACE_VAR, SUPERVISOR_VAR

KEEPALIVE = (1, 1, 2)  # seconds idle, seconds between probes, probes: a silent node is noticed in ~3 s
ANSWER_WAIT_S = 120.0  # how long a rank whose job failed waits for its supervisor's word
_KEPT: list[socket.socket] = []  # this rank's connection to its supervisor, open while the process lives
_ANSWERS: queue.Queue[str] = queue.Queue()  # the supervisor's words, as the listener read them
# a failure of the ranks' communication (a peer gone, a collective or rendezvous timed out), not of the job's code
_COMMUNICATION = re.compile(r"gloo|NCCL|c10d|ProcessGroup|rendezvous|Connection (reset|closed|refused)|Broken pipe|"
                            r"[Tt]imed out")


def supervised() -> bool:
    """Whether this process reported in to a supervisor that may start it again in place."""
    return bool(_KEPT)


def adopt(env: MutableMapping[str, str]) -> None:
    """A rank started again alone (``IN_PLACE_VAR``: ``RANKS;WORLD;NODES;TASKS_PER_NODE``): its
    launcher facts become those of the rank it replaces in the step that goes on, before anything
    (the bootstrap, submitit's result file) reads them. Nothing changes in any other process."""
    spec = env.get(IN_PLACE_VAR, "")
    if not spec:
        return
    ranks, world, nodes, per_node = spec.split(";")
    rank, tasks = int(ranks.split(",")[int(env.get("SLURM_PROCID", "0"))]), int(per_node)
    count = str(len(nodes.split(",")))
    env.update({"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % tasks), "SLURM_NODEID": str(rank // tasks),
                "SLURM_NTASKS": world, "SLURM_NPROCS": world, "SLURM_STEP_NUM_TASKS": world,
                "SLURM_STEP_NUM_NODES": count, "SLURM_NNODES": count, "SLURM_STEP_NODELIST": nodes,
                "SLURM_STEP_TASKS_PER_NODE": f"{tasks}(x{count})", "SLURM_TASKS_PER_NODE": f"{tasks}(x{count})"})
    for name, value in (("PMIX_RANK", rank), ("PMI_RANK", rank), ("PMI_SIZE", world)):
        if name in env:  # srun --mpi=pmix (a site's MpiDefault) names the rank there too
            env[name] = str(value)


def report_in(env: Mapping[str, str] | None = None) -> None:
    """In a rank of a job with spares: connect to the supervisor and say who this is (its step,
    rank and node). Nothing happens outside such a job, or when the supervisor cannot be reached
    (it then learns of this rank only from its step)."""
    env = os.environ if env is None else env
    where = env.get(SUPERVISOR_VAR, "")
    if not where:
        return
    host, _, port = where.rpartition(":")
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(f"{env.get('SLURM_STEP_ID', '')} {env.get('SLURM_PROCID', '')} {node}\n".encode())
    except (OSError, ValueError) as exc:
        print(f"hpcdist: warning: cannot reach the job's supervisor at {where}: {exc}", file=sys.stderr, flush=True)
        return
    sock.settimeout(None)
    _KEPT.append(sock)
    threading.Thread(target=_listen, args=(sock,), name="hpcdist-supervisor", daemon=True).start()


def _listen(sock: socket.socket) -> None:
    """The supervisor's words: ``again N`` and ``stop`` kept for ``again``; ``kill``: this rank hung
    while the others' collectives failed, and ends now (SIGKILL: srun reports it killed, and the
    supervisor starts it again alone)."""
    buffer = b""
    while True:
        try:
            data = sock.recv(256)
        except OSError:
            data = b""
        if not data:
            _ANSWERS.put("stop")
            return
        buffer += data
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            word = line.decode(errors="replace").strip()
            if word == "kill":
                print("hpcdist: this rank hung while the others' collectives failed: its supervisor ends it, to "
                      "start it again", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            _ANSWERS.put(word)


def communication_failure(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it came from, is a failure of the ranks' communication (a
    torch.distributed error, gloo's or NCCL's, a rendezvous), as a peer's death or hang causes."""
    from hpcdist.errors import BootstrapError, chain

    return any(isinstance(cur, (ConnectionError, TimeoutError, BootstrapError)) or type(cur).__name__.startswith("Dist")
               or (isinstance(cur, RuntimeError) and _COMMUNICATION.search(str(cur))) for cur in chain(exc))


def again(comm: bool, restart: int) -> int | None:
    """After this rank's job raised in its run of restart number `restart` (`comm`: a failure of
    its communication, ``communication_failure``): the restart number under which it runs the job
    again in this process, when the supervisor
    found another rank's process dead (or hung) on a live node, or every rank's communication
    failed; None when the failure is the job's own (or there is no supervisor to ask, or it did
    not answer within ``ANSWER_WAIT_S``), and the rank ends with it."""
    if not _KEPT:
        return None
    try:
        _KEPT[0].sendall(f"failed {'comm' if comm else 'own'} {restart}\n".encode())
        told = [_ANSWERS.get(timeout=ANSWER_WAIT_S)]
    except (OSError, queue.Empty):
        return None
    while not _ANSWERS.empty():  # words sent while this rank still ran: the latest counts
        told.append(_ANSWERS.get_nowait())
    if "stop" in told:
        return None
    numbers = [int(w.split()[1]) for w in told if len(w.split()) == 2 and w.split()[1].isdigit()]
    return max(numbers) if numbers else None


def done() -> None:
    """This rank's job succeeded: its supervisor is told before the process ends (an end it then
    need not look into)."""
    for sock in _KEPT:
        try:
            sock.sendall(b"done\n")
        except OSError:
            pass


# ---------------------------------------------------------------------- the supervisor's end


@dataclass
class Link:
    """A rank's connection as the supervisor holds it: its node and rank once it said them,
    whether its job failed and it waits for the supervisor's word, or succeeded."""

    node: str = ""
    rank: int = -1
    buffer: bytes = b""
    failed: str = ""  # its job failed: "comm" (a collective or rendezvous: a peer's fault) or "own"
    done: bool = False  # its job succeeded: the process ends next


class Links:
    """The supervisor's listening socket and every rank's connection, each kept with TCP keepalives
    (``KEEPALIVE``): a node whose kernel stops answering (dead, or cut off) is noticed in about
    3 s; a rank's process that ends closes its connection at once."""

    def __init__(self, address: str) -> None:
        self.server = socket.create_server((address, 0))
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ)
        self.address = f"{address}:{self.server.getsockname()[1]}"
        self.steps: set[str] = set()  # the Slurm step ids the ranks named

    def events(self, timeout: float, nodes: Sequence[str], restart: int) -> list[tuple[socket.socket | None, Link,
                                                                                    OSError | None]]:
        """What the connections did within `timeout`: a line read (the socket), or an end (None,
        with the error when it did not end cleanly); new connections accepted. A hello naming a
        node outside `nodes` (the step's) is ignored, and so is a failure in a run before
        `restart` (the current restart number): the rank was told ``again`` already."""
        out: list[tuple[socket.socket | None, Link, OSError | None]] = []
        for key, _ in self.sel.select(timeout):
            if key.fileobj is self.server:
                conn, _ = self.server.accept()
                _keepalive(conn)
                self.sel.register(conn, selectors.EVENT_READ, Link())
                continue
            sock, link = key.fileobj, key.data
            assert isinstance(sock, socket.socket)
            error: OSError | None = None
            try:
                data = sock.recv(4096)
            except OSError as exc:
                data, error = b"", exc
            if data:
                self._lines(link, data, nodes, restart)
                out.append((sock, link, None))
                continue
            self.sel.unregister(sock)
            sock.close()
            out.append((None, link, error))
        return out

    def _lines(self, link: Link, data: bytes, nodes: Sequence[str], restart: int) -> None:
        link.buffer += data
        while b"\n" in link.buffer:
            line, _, link.buffer = link.buffer.partition(b"\n")
            words = line.decode(errors="replace").split()
            if not link.node and len(words) == 3 and words[2] in nodes and words[1].isdigit():
                link.node, link.rank = words[2], int(words[1])
                if words[0].isdigit():
                    self.steps.add(words[0])
            elif link.node and len(words) == 3 and words[0] == "failed" and words[2].isdigit():
                if int(words[2]) >= restart:
                    link.failed = "comm" if words[1] == "comm" else "own"
            elif link.node and words == ["done"]:
                link.done = True
        link.buffer = link.buffer[-256:]

    def ranks(self) -> list[Link]:
        """The connections of ranks that said who they are."""
        return [key.data for key in self.sel.get_map().values() if key.fileobj is not self.server
                and key.data.rank >= 0]

    def connected(self, nodes: set[str]) -> int:
        return sum(1 for key in self.sel.get_map().values() if key.fileobj is not self.server
                   and key.data.node in nodes)

    def tell(self, word: str, ranks: Sequence[Link] | None = None) -> None:
        """`word` to `ranks` (all that said who they are)."""
        for key in list(self.sel.get_map().values()):
            if key.fileobj is not self.server and key.data.rank >= 0 and (
                    ranks is None or any(key.data is r for r in ranks)):
                try:
                    key.fileobj.sendall(f"{word}\n".encode())  # type: ignore[union-attr]
                except OSError:
                    pass  # its end comes as an event
                key.data.failed = ""

    def close_all(self) -> None:
        """Every rank's connection closed (the listening socket stays); the step ids forgotten."""
        for key in list(self.sel.get_map().values()):
            if key.fileobj is not self.server:
                self.sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
        self.steps = set()


def _keepalive(sock: socket.socket) -> None:
    idle, interval, count = KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)

"""A rank's side of the in-job supervisor (``hpcdist.runtime.in_job``) of a job with spare nodes.

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
import signal
import socket
import sys
import threading
from collections.abc import Mapping, MutableMapping

from hpcdist.config.contract import IN_PLACE_VAR, SUPERVISOR_VAR

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
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (ConnectionError, TimeoutError)) or type(cur).__name__.startswith("Dist") or (
                isinstance(cur, RuntimeError) and _COMMUNICATION.search(str(cur))) or (
                type(cur).__name__ == "BootstrapError"):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def again(exc: BaseException) -> int | None:
    """After this rank's job raised `exc`: the restart number under which it runs the job again in
    this process, when the supervisor found another rank's process dead (or hung) on a live node,
    or every rank's communication failed; None when the failure is the job's own (or there is no
    supervisor to ask, or it did not answer within ``ANSWER_WAIT_S``), and the rank ends with it."""
    if not _KEPT:
        return None
    try:
        _KEPT[0].sendall(b"failed comm\n" if communication_failure(exc) else b"failed\n")
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

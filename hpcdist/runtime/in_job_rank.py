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
import socket
import sys
from collections.abc import Mapping, MutableMapping

from hpcdist.config.contract import IN_PLACE_VAR, SUPERVISOR_VAR

ANSWER_WAIT_S = 120.0  # how long a rank whose job failed waits for its supervisor's word
IN_PLACE_GRACE_S = 10.0  # another rank failed: how long this one may take to raise on its own, in place
_KEPT: list[socket.socket] = []  # this rank's connection to its supervisor, open while the process lives


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
    _KEPT.append(sock)


def again() -> int | None:
    """After this rank's job failed: the restart number under which it runs the job again in this
    process, when the supervisor found that another rank's process died on a live node; None when
    the failure is the job's own (or there is no supervisor to ask), and the rank ends with it."""
    if not _KEPT:
        return None
    sock, data = _KEPT[0], b""
    try:
        sock.settimeout(ANSWER_WAIT_S)
        sock.sendall(b"failed\n")
        while not data.endswith(b"\n"):
            chunk = sock.recv(256)
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    told = [line.split() for line in data.decode(errors="replace").splitlines()]
    numbers = [int(words[1]) for words in told if len(words) == 2 and words[0] == "again" and words[1].isdigit()]
    return max(numbers) if numbers and all(words[:1] != ["stop"] for words in told) else None

"""The connection between each rank of a job with spare nodes and its in-job supervisor
(``hpcdist.runtime.in_job``): the line protocol, and the rank's end of it. A rank says ``hello NONCE
STEP RANK NODE`` as it starts (the supervisor answers ``hello``), ``failed own|comm RESTART`` when
its job raised, ``done`` when it succeeded; the supervisor answers ``again N``, ``stop``, or
``kill`` (a hung rank ends itself).

- **The job's line alone.** The supervisor's port is reachable by every user with a step on the
  batch node (``/proc/net/tcp`` lists it). Every line, both ways, carries an HMAC-SHA256 made with
  the job's key (the 0600 key file that also signs its rendezvous store,
  ``hpcdist.runtime.signed_store``) over the direction, the connection's nonce (the rank's, random,
  in its hello), a sequence number and the words; a reader takes only a line whose MAC matches and
  whose sequence is above the last it took on that connection, and a hello whose nonce it has not
  seen. A forged, replayed or foreign line is logged and ignored, and connections are bounded
  (``hpcdist.runtime.in_job_port``, the supervisor's end).
- **Sign of life.** The task runner connects to the supervisor as it starts (``report_in``) and
  says who it is; the connection stays open for the process's life, and its kernel answers the
  supervisor's keepalives.
- **In-place restart.** When a rank's process dies on a node that lives (killed, the OOM killer,
  a segfault), the other ranks are not started again: their job raises (a collective's peer is
  gone), and the task runner asks the supervisor (``again``), which answers with the next restart
  number. The rank then runs the job again in the same process (``IN_JOB_RESTART_VAR`` set: a
  new rendezvous, a new process group, the resume from the last checkpoint), with torch and the
  job's modules already imported. Only the dead rank gets a new process: a step of its own on
  its node, which takes the rank it replaces (``adopt``, from ``IN_PLACE_VAR``).
"""

from __future__ import annotations

import faulthandler
import hashlib
import hmac
import os
import queue
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from hpcdist.config.contract import IN_PLACE_VAR, SUPERVISOR_VAR

ANSWER_WAIT_S = 120.0  # how long a rank whose job failed waits for its supervisor's word
HELLO_TRIES = 5  # connections a rank makes until the supervisor answers its hello
LINE_MAX = 1024  # a line longer than this is no line of the protocol
RANK, SUPERVISOR = "rank", "supervisor"  # who signed a line: each end signs its own direction
_DOMAIN = b"hpcdist-link-1\0"


def seal(key: bytes, nonce: str, side: str, seq: int, words: str) -> bytes:
    """The line `words`, signed by `side` on the connection `nonce` as its `seq`-th."""
    return f"{_mac(key, nonce, side, seq, words)} {seq} {words}\n".encode()


def unseal(key: bytes, nonce: str, side: str, line: str, after: int) -> tuple[int, str] | None:
    """(sequence, words) of `line` when `side` signed it with `key` on the connection `nonce` and its
    sequence is above `after` (the last taken); None for anything else: forged, altered, replayed,
    or signed for another connection or direction."""
    parts = line.strip().split(" ", 2)
    if len(parts) != 3 or not parts[1].isdigit() or len(parts[1]) > 20:
        return None
    mac, seq, words = parts[0], int(parts[1]), parts[2]
    if seq <= after or not hmac.compare_digest(mac.encode(), _mac(key, nonce, side, seq, words).encode()):
        return None
    return seq, words


def _mac(key: bytes, nonce: str, side: str, seq: int, words: str) -> str:
    message = b"\0".join((_DOMAIN, side.encode(), nonce.encode(), str(seq).encode(), words.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------- the rank's end


@dataclass
class _Line:
    """This rank's connection to its supervisor, open while the process lives."""

    sock: socket.socket
    key: bytes
    nonce: str
    sent: int = 0  # the sequence of this rank's last line (its hello is 0)
    heard: int = 0  # the sequence of the supervisor's last line taken
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, words: str) -> None:
        with self.lock:
            self.sent += 1
            self.sock.sendall(seal(self.key, self.nonce, RANK, self.sent, words))


_KEPT: list[_Line] = []
_ANSWERS: queue.Queue[str] = queue.Queue()  # the supervisor's words, as the listener read them


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


def job_key(folder: str, env: Mapping[str, str]) -> bytes | None:
    """The job's key (its 0600 key file in submitit's folder `folder`), for both ends of the line;
    None when the job has none. BootstrapError for a file that is not this user's own 0600 one."""
    from hpcdist.config.contract import array_task_id
    from hpcdist.runtime import signed_store

    job_id = array_task_id(env) or env.get("SLURM_JOB_ID", "")
    path = signed_store.key_file({**env, "SUBMITIT_FOLDER": folder}, job_id)
    return signed_store.wait_for_key(path, signed_store.KEY_WAIT_S)


def report_in(folder: str, env: Mapping[str, str] | None = None) -> None:
    """In a rank of a job with spares: connect to the supervisor and say, signed with the job's key,
    who this is (its step, rank and node), until the supervisor answers ``hello`` (a connection it
    closed unanswered, past its bound on waiting connections, is made again, up to
    ``HELLO_TRIES`` times). Nothing happens outside such a job, or when the supervisor cannot be
    reached or the job has no key (it then learns of this rank only from its step)."""
    from hpcdist.errors import BootstrapError

    env = os.environ if env is None else env
    where = env.get(SUPERVISOR_VAR, "")
    if not where:
        return
    host, _, port = where.rpartition(":")
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    why = ""
    try:
        key = job_key(folder, env)
        if key is None:
            raise BootstrapError(f"the job has no key file in {folder} to sign its lines with")
        for _ in range(HELLO_TRIES):
            line = _Line(socket.create_connection((host, int(port)), timeout=10), key, secrets.token_hex(16))
            who = f"{env.get('SLURM_STEP_ID') or '-'} {env.get('SLURM_PROCID') or '-'} {node}"
            line.sock.sendall(seal(key, line.nonce, RANK, 0, f"hello {line.nonce} {who}"))
            why = _answered(line)
            if not why:
                break
            line.sock.close()
            time.sleep(1.0)
    except (OSError, ValueError, BootstrapError) as exc:
        why = str(exc)
    if why:
        print(f"hpcdist: warning: cannot report to the job's supervisor at {where}: {why}; this rank is not "
              f"started again in place", file=sys.stderr, flush=True)
        return
    line.sock.settimeout(None)
    for option, value in ((socket.TCP_KEEPIDLE, 1), (socket.TCP_KEEPINTVL, 1), (socket.TCP_KEEPCNT, 2)):
        line.sock.setsockopt(socket.IPPROTO_TCP, option, value)  # a dead supervisor's node: noticed in ~3 s
    line.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    _KEPT.append(line)
    threading.Thread(target=_listen, args=(line, folder, env), name="hpcdist-supervisor", daemon=True).start()


def _answered(line: _Line) -> str:
    """"" once the supervisor's signed ``hello`` came on `line`; else why not (it closed the
    connection, or said nothing within 10 s)."""
    buffer = b""
    while b"\n" not in buffer:
        try:
            data = line.sock.recv(256)
        except OSError as exc:
            return f"no answer to its hello ({exc})"
        if not data:
            return "the supervisor closed the connection unanswered"
        buffer += data
    taken = unseal(line.key, line.nonce, SUPERVISOR, buffer.partition(b"\n")[0].decode(errors="replace"), 0)
    if taken is None or taken[1] != "hello":
        return "its answer was not signed with the job's key"
    line.heard = taken[0]
    return ""


def _listen(line: _Line, folder: str, env: Mapping[str, str]) -> None:
    """The supervisor's words, each checked: ``again N`` and ``stop`` kept for ``again``; ``kill``:
    this rank hung while the others' collectives failed, and ends now (SIGKILL: srun reports it
    killed, and the supervisor starts it again alone). A line not signed by the supervisor on this
    connection is said and ignored. A connection that timed out may be the batch node's death,
    which Slurm does not end a ``--no-kill`` job for: ``standby.supervisor_lost`` looks into it."""
    buffer = b""
    while True:
        try:
            data = line.sock.recv(256)
        except OSError:
            _ANSWERS.put("stop")
            from hpcdist.runtime.standby import supervisor_lost

            supervisor_lost(folder, env)
            return
        if not data:
            _ANSWERS.put("stop")
            return
        buffer += data
        while b"\n" in buffer:
            raw, _, buffer = buffer.partition(b"\n")
            taken = unseal(line.key, line.nonce, SUPERVISOR, raw.decode(errors="replace"), line.heard)
            if taken is None:
                print("hpcdist: warning: ignored a line from the supervisor's connection not signed with the job's "
                      "key", file=sys.stderr, flush=True)
                continue
            line.heard, word = taken
            if word == "kill":
                print("hpcdist: this rank hung while the others' collectives failed: its supervisor ends it, to "
                      "start it again; where each of its threads was:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(sys.stderr, all_threads=True)  # what the user asks first: stuck where?
                os.kill(os.getpid(), signal.SIGKILL)
            _ANSWERS.put(word)
        buffer = buffer[-LINE_MAX:]


def communication_failure(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it came from, is a failure of the ranks' communication, as a
    peer's death or hang causes: torch.distributed's own errors (``DistError`` and its kinds, the
    backend's, the network's and the store's), a RuntimeError of gloo, NCCL or c10d (their source
    file or their name in the text), a connection or time-out error raised inside
    torch.distributed, or hpcdist's rendezvous (``BootstrapError``). An exception of the job's own
    code is not, whatever its class is called or its text says (its own I/O's ConnectionError or
    "Timed out"): running it again would fail again."""
    from hpcdist.errors import BootstrapError, chain

    dist_error = _dist_error()
    for cur in chain(exc):
        if isinstance(cur, BootstrapError) or (dist_error is not None and isinstance(cur, dist_error)):
            return True
        if isinstance(cur, RuntimeError) and _LIBRARY.search(str(cur)):
            return True
        if isinstance(cur, (RuntimeError, ConnectionError, TimeoutError)) and _raised_in_torch_distributed(cur):
            return True
    return False


_LIBRARY = re.compile(r"gloo/|\bProcessGroup(Gloo|NCCL|MPI)\b|\bNCCL (error|WARN|communicator)|"
                                    r"\[c10d\]|\bc10d::")


def _dist_error() -> type[BaseException] | None:
    dist = sys.modules.get("torch.distributed")
    found = getattr(dist, "DistError", None) if dist is not None else None
    return found if isinstance(found, type) else None


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename


def again(comm: bool, restart: int) -> int | None:
    """After this rank's job raised in its run of restart number `restart` (`comm`: a failure of
    its communication, ``communication_failure``): the restart number under which it runs the job
    again in this process, when the supervisor found another rank's process dead (or hung) on a
    live node, or every rank's communication failed; None when the failure is the job's own (or
    there is no supervisor to ask, or it did not answer within ``ANSWER_WAIT_S``), and the rank
    ends with it."""
    if not _KEPT:
        return None
    try:
        _KEPT[0].send(f"failed {'comm' if comm else 'own'} {restart}")
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
    for line in _KEPT:
        try:
            line.send("done")
        except OSError:
            pass

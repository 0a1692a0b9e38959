"""torchrun's agent, kept alive through the preemption signal; and the head node's address.

Slurm's ``--signal=SIG@N`` reaches every process of the step: the workers, which checkpoint
and requeue on it, and torchrun's agent, which handles only SIGTERM, SIGINT, SIGHUP and SIGQUIT
and so would die of SIGUSR1/SIGUSR2 and take its workers with it. Here the agent notes the
signal in its log and carries on; the workers act on their own copy of it.

``python -m hpcdist.runtime.agent --address IFNAME`` prints this host's IPv4 address on IFNAME
(the job script runs it on the head node, where the c10d rendezvous listens).
``python -m hpcdist.runtime.agent --free-port`` prints a TCP port free on this host (the job
script runs it on the head node: each job's c10d store gets its own port).
``python -m hpcdist.runtime.agent [--ifname IFNAME] TORCHRUN_ARGS...`` runs torchrun; with
``--ifname`` the agent announces its node by that address (torchrun's ``--local-addr``), which
the workers then get as MASTER_ADDR, instead of a host name that has to resolve. Under Slurm the
agent of the step's node 0 (the head node) hosts the c10d store and every other agent is its
client (``--rdzv-conf is_host``): torch's own guess would quietly connect to whatever holds the
port when the head node cannot bind it.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

# The variable the job script sets to the site's preemption signal (USR1, USR2, ...).
SIGNAL_VAR = "SUBMITIT_PREEMPTION_SIGNAL"


def _note(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    print(f"hpcdist agent {os.getpid()}: {name} (preemption) noted; the workers handle it, the agent stays",
          file=sys.stderr, flush=True)


def keep_alive_on(name: str | None) -> signal.Signals | None:
    """Install the note-and-continue handler for the preemption signal `name` (e.g. "USR2").

    SIGTERM and SIGINT stay with torchrun, which stops its workers on them.
    """
    if not name:
        return None
    sig = signal.Signals[f"SIG{name.removeprefix('SIG')}"]
    if sig in (signal.SIGTERM, signal.SIGINT):
        return None
    signal.signal(sig, _note)
    return sig


def free_port() -> int:
    """A TCP port no socket of this host holds now (the kernel's pick)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def with_is_host(argv: list[str], node_id: str | None) -> list[str]:
    """torchrun's arguments with ``is_host`` in its ``--rdzv-conf``: true on node 0 only."""
    if node_id is None or not node_id.isdigit():
        return argv
    conf = f"is_host={'true' if int(node_id) == 0 else 'false'}"
    out = list(argv)
    for i, arg in enumerate(out):
        for flag in ("--rdzv-conf", "--rdzv_conf"):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = f"{out[i + 1]},{conf}"
                return out
            if arg.startswith(flag + "="):
                out[i] = f"{arg},{conf}"
                return out
    return [f"--rdzv-conf={conf}", *out]


def main(argv: list[str]) -> int:
    if argv == ["--free-port"]:
        print(free_port())
        return 0
    if len(argv) == 2 and argv[0] == "--address":
        from hpcdist.errors import HpcdistError
        from hpcdist.runtime.group import own_address

        try:
            print(own_address(argv[1], single_node=False))
        except HpcdistError as exc:
            print(f"hpcdist: error: {exc}", file=sys.stderr)
            return 1
        return 0
    if argv[:1] == ["--ifname"] and len(argv) > 1:
        from hpcdist.runtime.group import own_address

        argv = [f"--local-addr={own_address(argv[1], single_node=False)}", *argv[2:]]
    argv = with_is_host(argv, os.environ.get("SLURM_NODEID"))
    keep_alive_on(os.environ.get(SIGNAL_VAR))
    from torch.distributed.run import main as torchrun

    torchrun(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

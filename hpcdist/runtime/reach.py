"""After a collective fails: which nodes still answer, so the error can name the one that does not.

A gloo or NCCL time-out says only that a receive timed out. Each rank that catches such a
failure answers a short roll call over the rendezvous store (a separate TCP connection to rank
0, not the failed group), waits a few seconds for the others, and names the nodes whose ranks
never answered; a rank that cannot reach the store at all names rank 0's node, which serves it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

ROLL_CALL_S = 5.0


def _default_store() -> Any:
    import torch.distributed as dist

    try:  # the store the default group was made over (hpcdist's rendezvous store)
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no group, or torch moved the helper: no roll call, no claim
        return None


def roll_call(rank: int, host_of_rank: Sequence[str], wait_s: float = ROLL_CALL_S, store: Any = None) -> str:
    """A phrase naming the nodes whose ranks did not answer within `wait_s`, or "" if all did."""
    store = store if store is not None else _default_store()
    if store is None:
        return ""
    world = len(host_of_rank)
    missing: list[int] = list(range(world))
    done = threading.Event()

    def call() -> None:
        nonlocal missing
        import torch.distributed as dist

        roll = dist.PrefixStore("hpcdist/rollcall", store)
        roll.set(str(rank), "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not roll.check([str(r)])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        done.set()

    threading.Thread(target=call, name="hpcdist-roll-call", daemon=True).start()
    if not done.wait(wait_s + 2.0):
        return (f"{host_of_rank[0]} does not answer (rank 0 there serves the rendezvous store; "
                f"no reply within {wait_s:g} s): the link to {host_of_rank[0]} is down or its ranks are gone")
    if not missing:
        return ""
    by_node: dict[str, list[int]] = {}
    for r in missing:
        by_node.setdefault(host_of_rank[r], []).append(r)
    named = ", ".join(f"{node} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                      for node, rs in by_node.items())
    return f"no answer within {wait_s:g} s from {named}: the link to {', '.join(by_node)} is down or its ranks are gone"


def failure_message(what: str, rank: int, host_of_rank: Sequence[str], exc: BaseException) -> str:
    """`what` failed on this rank: the cause's first line and the nodes that stopped answering."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    gone = roll_call(rank, host_of_rank)
    return (f"{what} failed on rank {rank} ({host_of_rank[rank]}): {type(exc).__name__}: {first}"
            + (f"; {gone}" if gone else ""))

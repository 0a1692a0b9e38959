"""After a collective fails: which nodes still answer, so the error can name the one that does not.

A gloo or NCCL time-out says only that a receive timed out. Each rank that catches such a
failure answers a short roll call over the rendezvous store (a separate TCP connection to rank
0, not the failed group), waits a few seconds for the others, and names the nodes whose ranks
never answered; a rank that cannot reach the store at all names rank 0's node, which serves it.
A transport error that quotes a peer's address ("Connection closed by peer [10.0.0.12]:4711")
also gets the rank(s) and node behind that address.

After a time-out (not a closed connection: a peer's kernel that resets the connection is alive,
only its process died), the roll call may also mark in the site's node health record
(``hpcdist.store.records.health``, source ``timeout``) a node none of whose ranks answered, once: by
the lowest rank that did answer, on the store's side of the break. Silence in the store is not
evidence against a node: anyone who reaches the store's port can delete an answer. So a silent
node is marked only on evidence no one at the store can make: Slurm says it is not responding
(or down), or its slurmd's address does not answer a TCP connect within ``PROBE_S`` (a refused
connection is an answer: the node's kernel is alive). A silent node that answers on the network
is named in the error, not marked. A rank that cannot reach the store marks nothing: cut off
itself, it cannot tell its own node from rank 0's. Only a Slurm site is marked (the local site is
one machine).
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from hpcdist.errors import HpcdistError, cause_text

if TYPE_CHECKING:
    from hpcdist.config.site import Site

ROLL_CALL_S = 5.0
PROBE_S = 1.0  # a live node's kernel answers a connect within milliseconds on a cluster's network


def _default_store() -> Any:
    import torch.distributed as dist

    from hpcdist.runtime import signed_store

    job = signed_store.job_store()
    if job is not None:  # the job's rendezvous store: the answers signed, a forged one not counted
        return job
    try:  # the store the default group was made over (a group made outside hpcdist's rendezvous)
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no group, or torch moved the helper: no roll call, no claim
        return None


def roll_call(rank: int, host_of_rank: Sequence[str], wait_s: float = ROLL_CALL_S, store: Any = None,
              site: Site | None = None, job_id: str = "", what: str = "a collective",
              verdict_s: float | None = None) -> str:
    """A phrase naming the nodes whose ranks did not answer within `wait_s`, or "" if all did;
    with `site`, those nodes are marked in its health record (after `what` failed in `job_id`).
    `verdict_s`: how long past `wait_s` a rank waits for the verdict (``verdict_wait_s``).

    Each rank answers (a signed key and a counter) and waits once for the verdict, which the first
    rank to answer makes: when the count is complete or `wait_s` has passed, it checks which
    answers are there (halving the set of keys, so one silent rank costs it a few dozen requests)
    and that they are genuine, and publishes the ranks missing. So a rank's roll call is a handful
    of requests and bytes whatever the world size, and no rank polls. Where the verdict does not
    come (its maker died after answering), a rank finds the missing ranks itself. The roll call
    runs in a thread of its own, so that a store that stops answering costs no more than its
    bound; where no thread can start (the node's limit on tasks: 16,384 ranks simulated as threads
    reach this machine's 32,768), it runs in the caller's, rather than raise over the failure
    being reported."""
    store = store if store is not None else _default_store()
    if store is None:
        return ""
    world = len(host_of_rank)
    verdict_s = verdict_wait_s(world) if verdict_s is None else verdict_s
    verdict: list[list[int] | None] = []
    done = threading.Event()

    def call() -> None:
        from hpcdist.runtime.signed_store import signed

        try:
            verdict.append(_answer(signed(store), rank, world, wait_s, verdict_s))
        except Exception:  # noqa: BLE001 - the store does not answer: said below
            verdict.append(None)
        done.set()

    try:
        threading.Thread(target=call, name="hpcdist-roll-call", daemon=True).start()
    except RuntimeError:  # no thread to spare (the node's limit on tasks): answer in this one, each wait
        call()  # bounded as in the thread, the others by the store's own timeout
    if not done.wait(wait_s + verdict_s + 2.0) or verdict[0] is None:
        return (f"{host_of_rank[0]} does not answer (rank 0 there serves the rendezvous store; "
                f"no reply within {wait_s:g} s): the link to {host_of_rank[0]} is down or its ranks are gone")
    missing = verdict[0]
    if not missing:
        return ""
    by_node: dict[str, list[int]] = {}
    for r in missing:
        by_node.setdefault(host_of_rank[r], []).append(r)
    silent_ranks = set(missing)
    first_answer = next((r for r in range(world) if r not in silent_ranks), None)
    if site is not None and rank == first_answer:
        silent = [n for n, rs in by_node.items() if len(rs) == list(host_of_rank).count(n)]  # every rank there
        _mark(site, silent, job_id, f"no rank answered the roll call within {wait_s:g} s after {what} failed")
    named = ", ".join(f"{node} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                      for node, rs in by_node.items())
    return f"no answer within {wait_s:g} s from {named}: the link to {', '.join(by_node)} is down or its ranks are gone"


_KEY = "hpcdist/rollcall"


def verdict_wait_s(world: int) -> float:
    """Beyond `wait_s`: how long a rank waits for the verdict before finding the missing ranks
    itself; the store wakes every waiting rank in turn, so it grows with them (17 s at 16,384)."""
    return 1.0 + world / 1000


def _answer(roll: Any, rank: int, world: int, wait_s: float, verdict_s: float) -> list[int]:
    """Answer the roll call, then the ranks that did not (`roll`: the job's SignedStore)."""
    from datetime import timedelta

    roll.set(f"{_KEY}/{rank}", "1")
    order = roll.add(_KEY, 1)
    if order == world:
        roll.set(f"{_KEY}/all", "1")
    if order != 1:
        try:
            return [int(r) for r in json.loads(roll.fetch([f"{_KEY}/verdict"],
                                                          timedelta(seconds=wait_s + verdict_s))[0])]
        except Exception:  # noqa: BLE001 - no verdict in time (its maker stopped, or a forged count): look ourselves
            return _silent(roll, world)
    try:
        roll.fetch([f"{_KEY}/all"], timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - someone did not answer in time
        pass
    missing = _silent(roll, world)
    roll.set(f"{_KEY}/verdict", json.dumps(missing))
    return missing


def _silent(roll: Any, world: int) -> list[int]:
    """The ranks with no genuine answer: the absent found by halving (``check`` is one request for
    any number of keys), the present read in one request and their signatures checked (a forged
    answer counts as none). That read waited 0.1 s, and retried while a value was forged: at
    16,384 ranks simulated on this machine one request of every key took longer, and the maker
    then read the 16,383 answers one by one (``benchmarks/scale_sim.py``)."""
    from datetime import timedelta

    keys = [f"{_KEY}/{r}" for r in range(world)]
    absent: list[int] = []
    parts = [(0, world)] if world else []
    while parts:
        lo, hi = parts.pop()
        if roll.plain.check(keys[lo:hi]):
            continue
        if hi - lo == 1:
            absent.append(lo)
        else:
            parts += [((lo + hi) // 2, hi), (lo, (lo + hi) // 2)]
    gone = set(absent)
    present = [r for r in range(world) if r not in gone]
    try:  # all there: in one read, long enough for a request of every key to a busy store
        opened = roll.read([keys[r] for r in present], timedelta(seconds=1.0 + world / 10_000))
        forged = [r for r, value in zip(present, opened, strict=True) if value is None]
    except Exception:  # noqa: BLE001 - some answer went since it was checked: which, one by one
        forged = [r for r in present if roll.peek(keys[r]) is None]
    return sorted(absent + forged)


def slurm_node_name(host: str, known: Collection[str]) -> str | None:
    """Slurm's name for a rank's host (the record and ``--exclude`` speak Slurm's names): the host
    itself, or its first label (``n3`` for ``n3.cluster.local``), when Slurm knows it; else None."""
    for name in (host, host.split(".")[0]):
        if name in known:
            return name
    return None


def _mark(site: Site, nodes: Sequence[str], job_id: str, reason: str) -> None:
    """Mark those of `nodes` (the ranks' host names, silent at the roll call) that Slurm says are not
    responding or whose slurmd does not answer on the network, under Slurm's names; a host Slurm
    does not know, or one that answers, is logged, not marked. A record that cannot be written is
    logged, not raised: the failure being reported matters more."""
    import logging

    from hpcdist.scheduler import slurm_cluster
    from hpcdist.store.records import health

    log = logging.getLogger("hpcdist")
    known = slurm_cluster.node_states() if site.scheduler == "slurm" else None
    if known is None:
        return
    named = {host: slurm_node_name(host, known) for host in nodes}
    for host in [h for h, node in named.items() if node is None]:
        log.warning("not marking %s in the node health record: Slurm knows no node of that name (sinfo); "
                    "mark the node by hand with `hpcdist nodes --mark NODE --reason ...`", host)
    found_by_node = evidence([n for n in named.values() if n is not None], known)
    for node, found in found_by_node.items():
        if not found:
            log.warning("not marking %s in the node health record: its ranks did not answer the roll call, but "
                        "Slurm says it responds and its slurmd answers on the network (a missing answer alone "
                        "is no evidence: anyone who reaches the job's store can delete one); if the node is bad, "
                        "mark it with `hpcdist nodes --mark %s --reason ...`", node, node)
            continue
        try:
            health.mark(site, node, f"{reason}; {found}", job_id=job_id, source="timeout")
        except (OSError, HpcdistError) as exc:
            log.warning("could not mark %s in the node health record: %s", node, exc)


def evidence(nodes: Sequence[str], known: dict[str, Any],
             slurmds: dict[str, tuple[str, int]] | None = None) -> dict[str, str]:
    """For each of `nodes`, what shows it is gone ("" when nothing does): Slurm's state (`known`;
    a node it does not hold is judged by its slurmd alone), else a connect to its slurmd that got
    no answer within ``PROBE_S`` (the nodes probed at once). Its address is Slurm's, asked now;
    where the controller does not answer, `slurmds` (those it gave before)."""
    from hpcdist.scheduler.slurm_cluster import slurmd_addresses

    found = {node: f"Slurm says {known[node].state}" if node in known and known[node].failed else ""
             for node in nodes}
    unsaid = [node for node, said in found.items() if not said]
    addresses = ((slurmd_addresses(unsaid) if unsaid else {})
                 or {n: a for n, a in (slurmds or {}).items() if n in unsaid})
    probes = [threading.Thread(target=lambda n=node, a=address: found.update({n: _unanswered(a)}), daemon=True)
              for node, address in addresses.items()]
    for probe in probes:
        probe.start()
    for probe in probes:
        probe.join(PROBE_S + 1.0)
    return found


def _unanswered(address: tuple[str, int]) -> str:
    """"its slurmd at ADDR:PORT does not answer" when a TCP connect there got no reply within
    ``PROBE_S`` or the network says the host is unreachable; "" when it connected or was refused
    (a live kernel), or failed otherwise (no evidence either way)."""
    from hpcdist.scheduler.slurm_cluster import slurmd_silent

    return slurmd_silent(address, PROBE_S)


_PEER = re.compile(r"\[?\b(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+")


def peer_named(text: str, host_of_rank: Sequence[str]) -> str:
    """"the peer 10.0.0.12 is n2 (rank 1)" for each address quoted in `text` that is one of the
    job's nodes (names resolved here, on the failure path only); "" when none is."""
    quoted = list(dict.fromkeys(_PEER.findall(text)))
    if not quoted:
        return ""
    by_addr: dict[str, list[int]] = {}
    addr_of: dict[str, str] = {}
    for r, host in enumerate(host_of_rank):
        if host not in addr_of:
            try:
                addr_of[host] = socket.gethostbyname(host)
            except OSError:
                addr_of[host] = ""
        by_addr.setdefault(addr_of[host], []).append(r)
    named = []
    for addr in quoted:
        ranks = by_addr.get(addr)
        if ranks:
            which = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            named.append(f"the peer {addr} is {host_of_rank[ranks[0]]} ({which})")
    return "; ".join(named)


def timed_out(exc: BaseException) -> bool:
    """The failure was a wait that ran out (gloo's "Timed out", NCCL's watchdog, a TimeoutError),
    which is what a dead node or a cut link gives; a closed or reset connection is not."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def failure_message(what: str, rank: int, host_of_rank: Sequence[str], exc: BaseException,
                    site: Site | None = None, job_id: str = "") -> str:
    """`what` failed on this rank: the cause's first line, the peer it names, and the nodes that
    stopped answering (after a time-out, marked in `site`'s node health record, when given)."""
    from hpcdist.runtime import in_job_link

    peer = peer_named(str(exc), host_of_rank)
    # a job with spares: its supervisor checks the nodes itself, and the ranks do not wait for a roll call
    gone = "" if in_job_link.supervised() else roll_call(rank, host_of_rank, site=site if timed_out(exc) else None,
                                                          job_id=job_id, what=what)
    return (f"{what} failed on rank {rank} ({host_of_rank[rank]}): {cause_text(exc)}"
            + (f"; {peer}" if peer else "") + (f"; {gone}" if gone else ""))

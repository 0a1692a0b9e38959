"""The check-in: every rank announces itself in the job's store and learns every rank's host and,
under NCCL, its own GPU; a rank that does not come is named to all the others.

Per rank it costs the same few requests and bytes whatever the world size
(``benchmarks/scale_sim.py``): a seat, a counter, and one blocking read of what rank 0 publishes,
which is the host table packed as Slurm packs a node list (``host_table``) and only the GPU
placements rank 0 had to change. Rank 0 alone reads every seat, in one request. No rank polls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hpcdist.errors import BootstrapError, cause_text
from hpcdist.runtime import signed_store
from hpcdist.runtime.host_table import HostTable
from hpcdist.runtime.rankinfo import RankInfo

if TYPE_CHECKING:
    import torch.distributed as dist

    Store = signed_store.SignedStore | dist.Store  # hpcdist's messages: signed in a job, plain in tests

HOSTS_KEY = "hpcdist/hosts"
MISSING_GRACE_S = 5.0  # how long a rank whose wait ended waits for rank 0 to name the missing ranks


def check_in(store: Store, info: RankInfo, timeout: float) -> HostTable:
    """Every rank announces itself and waits for all others; returns rank -> host (`take_seats`
    without GPUs)."""
    return take_seats(store, info, timeout)[0]


def take_seats(store: Store, info: RankInfo, timeout: float, gpus: Sequence[str] = (),
               prefer: int = 0) -> tuple[HostTable, int | None]:
    """Every rank announces itself and waits for all others; returns rank -> host, and under NCCL
    this rank's GPU: an index into `gpus`, the UUIDs of the GPUs it sees, in CUDA's order.

    Rank 0, seeing every rank's GPUs, gives each a GPU of its own (``place_gpus``): where each task
    sees a subset (``--gpu-bind=closest``), the local rank modulo what a task sees would give two
    ranks one GPU. Ranks that can only have a GPU another rank has are refused here, on every rank
    with the same message, before NCCL's "Duplicate GPU detected" would stop ``init_process_group``
    naming neither the ranks nor what to change. `prefer` is the index this rank would take alone,
    and the one it gets unless rank 0 names another for it.

    Each rank sets its seat and bumps a counter; the last to arrive marks the roll complete; rank
    0 then reads every seat in one request and publishes the packed host table with the GPUs it
    moved, which every other rank waits for (one blocking wait, no polling). A rank missing after
    `timeout` is named in the error every waiting rank raises. The count only says when to look:
    rank 0 reads the signed seats themselves (``signed_store``), so a forged count or seat delays
    the roll, never changes it.
    """
    seat = f"{info.hostname} {prefer} {','.join(gpus)}" if gpus else info.hostname
    store.set(f"hpcdist/join/{info.rank}", seat)
    _count_in(store, "hpcdist/joined", info.world_size)
    within = timedelta(seconds=timeout)
    try:
        if info.is_main:
            store.wait(["hpcdist/joined/all"], within)
            keys = _rank_keys("hpcdist/join", info.world_size)  # rank 0's alone: N keys for each rank would be N^2
            seats = [v.decode().split(" ", 2) for v in signed_store.signed(store).fetch(keys, within)]
            placed, shared = place_gpus(seats)
            table: dict[str, Any] = ({"shared": shared} if shared else
                                     {"runs": HostTable.of([s[0] for s in seats]).runs, "gpus": _moved(seats, placed)})
            store.set(HOSTS_KEY, json.dumps(table))
        else:
            table = _published(store, timeout)
            if "missing" in table:  # rank 0 gave up: it names them to everyone
                raise _Missing(f"rank 0 saw rank(s) {_ranks(table['missing'])} missing", table["missing"])
    except Exception as exc:  # the wait timed out, or rank 0 (the store's server) gave up or died
        raise _not_joined(store, info, timeout, exc) from exc
    if "shared" in table:
        _all_refused(store, info, timeout)
        raise BootstrapError(table["shared"])
    gpu = int(table["gpus"].get(str(info.rank), prefer % len(gpus))) if gpus else None
    return HostTable(table["runs"]), gpu


class _Missing(TimeoutError):
    def __init__(self, text: str, ranks: list[int]) -> None:
        super().__init__(text)
        self.ranks = ranks


def _published(store: Store, timeout: float) -> dict[str, Any]:
    """What rank 0 published: the table, its refusal, or (its own wait over) the ranks missing, for
    which a rank whose wait ended first waits a little longer rather than read every seat itself."""
    try:
        raw = signed_store.signed(store).fetch([HOSTS_KEY], timedelta(seconds=timeout))[0]
    except Exception:  # noqa: BLE001 - timed out: rank 0's verdict comes at about the same time
        raw = signed_store.signed(store).fetch([HOSTS_KEY], timedelta(seconds=min(timeout, MISSING_GRACE_S)))[0]
    return dict(json.loads(raw))


def _moved(seats: list[list[str]], placed: list[int]) -> dict[str, int]:
    """The ranks whose GPU is not the one they preferred, and theirs (most jobs: none)."""
    return {str(r): g for r, (seat, g) in enumerate(zip(seats, placed, strict=True))
            if g >= 0 and g != int(seat[1]) % len(seat[2].split(","))}


def _not_joined(store: Store, info: RankInfo, timeout: float, exc: Exception) -> BootstrapError:
    """The error of a check-in that did not complete, naming the ranks that had not joined (rank 0
    publishes them, so the others need not read every seat)."""
    missing = exc.ranks if isinstance(exc, _Missing) else _missing(store, _rank_keys("hpcdist/join", info.world_size))
    if info.is_main and missing is not None:
        try:
            store.set(HOSTS_KEY, json.dumps({"missing": missing}))
        except Exception:  # noqa: BLE001 - best effort: the others time out on their own
            pass
    if missing is None:
        return BootstrapError(
            f"rendezvous: rank(s) ? of {info.world_size} had not joined when rank 0's store closed "
            f"(this is rank {info.rank} on {info.hostname}; {cause_text(exc)}); see rank 0's log")
    return BootstrapError(
        f"rendezvous: rank(s) {_ranks(missing) or 'none'} of {info.world_size} did not join within "
        f"{timeout:g} s (this is rank {info.rank} on {info.hostname}); the missing rank "
        f"died or was never started: see its log")


def _all_refused(store: Store, info: RankInfo, timeout: float) -> None:
    """Every rank has read rank 0's refusal before rank 0, the store's server, leaves with it: else a
    rank still waiting would see only the store close."""
    _count_in(store, "hpcdist/refused", info.world_size)
    if info.is_main:
        try:
            store.wait(["hpcdist/refused/all"], timedelta(seconds=min(timeout, 30.0)))
        except Exception:  # noqa: BLE001 - a rank that is gone cannot read it anyway
            pass


def place_gpus(seats: list[list[str]]) -> tuple[list[int], str]:
    """Each rank's GPU (an index into the GPUs it sees; -1 for a rank without) from every rank's seat
    (host, preferred index, comma-separated UUIDs): in rank order, each takes its preferred GPU, or
    the next one it sees that no rank on its host has taken. The refusal, when a rank finds none
    free, names it, the rank that holds its GPU and the host; else ""."""
    taken: dict[tuple[str, str], int] = {}
    out: list[int] = []
    for rank, seat in enumerate(seats):
        if len(seat) < 3 or not seat[2]:
            out.append(-1)
            continue
        host, prefer, uuids = seat[0], int(seat[1]), seat[2].split(",")
        order = [(prefer + i) % len(uuids) for i in range(len(uuids))]
        free = next((i for i in order if (host, uuids[i]) not in taken), None)
        if free is None:
            holder = taken[(host, uuids[prefer % len(uuids)])]
            return out, (f"ranks {holder}, {rank} were given one GPU ({uuids[prefer % len(uuids)]}) on {host}: NCCL "
                         f"needs a GPU per rank; bind one GPU per task (--gpus-per-task=1 or --gpu-bind) or set "
                         f"tasks_per_node to the GPUs per node")
        taken[(host, uuids[free])] = rank
        out.append(free)
    return out, ""


def _rank_keys(prefix: str, world_size: int) -> list[str]:
    return [f"{prefix}/{r}" for r in range(world_size)]


def _count_in(store: Store, counter: str, world_size: int) -> None:
    """Add this rank to `counter`; the rank that completes it sets ``<counter>/all`` for the waiters."""
    if store.add(counter, 1) == world_size:
        store.set(f"{counter}/all", "1")


def _missing(store: Store, keys: list[str]) -> list[int] | None:
    """The ranks whose key is absent (one request per rank: only after a failed wait, and by one
    rank); None when the store itself no longer answers."""
    try:
        return [r for r, k in enumerate(keys) if not store.check([k])]
    except Exception:  # noqa: BLE001 - the server is gone: any error means the same
        return None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)

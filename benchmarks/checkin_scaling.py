"""How long a full rendezvous check-in takes, and how many store requests it makes, as ranks grow.

Many ranks are simulated as clients of one TCPStore: each rank is a thread of this process with its
own TCP connection to the store (as each rank of a job has), and the store's server runs here too,
as rank 0's does. Two methods, in the same run, on the same store server:

- ``old``: the check-in hpcdist used before issue #10 item 10: every rank polls every rank's key
  (``store.check``) every 50 ms until all are present: O(n^2) requests;
- ``new``: ``hpcdist.runtime.group.check_in``: a counter (``store.add``), one blocking
  ``store.wait`` per rank, and one host table rank 0 publishes: O(n) requests.

Reported per rank count: the wall time from the first rank starting to the last rank holding the
full host table (median of --trials), the store requests made, and old / new ratios. The threads
share this machine's cores and the GIL, so absolute times are pessimistic; the request counts do
not depend on the machine. Run:

    python benchmarks/checkin_scaling.py --ranks 64 256 1024
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from hpcdist.runtime import group  # noqa: E402
from hpcdist.runtime.rankinfo import RankInfo  # noqa: E402

POLL_S = 0.05  # the old method's poll interval (group._POLL_S)


class Counted:
    """A store that counts the requests made through it (`tally`: one counter per run, shared)."""

    def __init__(self, store: Any, tally: itertools.count[int]) -> None:
        self._store, self._tally = store, tally

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            next(self._tally)  # atomic under the GIL
            return method(*args)

        return call


def old_check_in(store: Any, info: RankInfo, timeout: float) -> dict[int, str]:
    """The pre-fix check-in: set my key, then poll every key until all are there."""
    store.set(f"hpcdist/join/{info.rank}", info.hostname)
    keys = [f"hpcdist/join/{r}" for r in range(info.world_size)]
    deadline = time.monotonic() + timeout
    while any(not store.check([k]) for k in keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {info.rank}: check-in not complete within {timeout} s")
        time.sleep(POLL_S)
    return {r: store.get(k).decode() for r, k in enumerate(keys)}


def new_check_in(store: Any, info: RankInfo, timeout: float) -> dict[int, str]:
    return group.check_in(store, info, timeout)


def one_run(server: dist.TCPStore, world: int, method: Callable[..., dict[int, str]],
            timeout: float) -> tuple[float, int]:
    """Seconds until every rank holds the full host table, and the store requests made."""
    prefix = f"bench/{uuid.uuid4().hex}"
    tally = itertools.count()
    clients = [dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=timeout)) for _ in range(world)]
    stores = [Counted(dist.PrefixStore(prefix, c), tally) for c in clients]
    results: list[Any] = [None] * world
    start = threading.Barrier(world + 1)

    def rank(r: int) -> None:
        info = RankInfo(launcher="slurm", rank=r, world_size=world, local_rank=0, local_world_size=1,
                        node_rank=r, num_nodes=world, hostname=f"node{r:04d}")
        start.wait()
        try:
            results[r] = method(stores[r], info, timeout)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    want = {r: f"node{r:04d}" for r in range(world)}
    bad = [r for r, got in enumerate(results) if got != want]
    if bad:
        raise SystemExit(f"{method.__name__} at {world} ranks: rank {bad[0]} got {results[bad[0]]!r}")
    del clients
    return took, next(tally)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=args.timeout), wait_for_workers=False)
    print(f"check-in of N simulated ranks (threads, one TCPStore connection each) against one store; "
          f"median of {args.trials} trials")
    print(f"{'ranks':>6} {'old s':>9} {'new s':>8} {'time old/new':>12} {'old requests':>13} "
          f"{'new requests':>13} {'requests old/new':>16}")
    for world in args.ranks:
        runs: dict[str, list[tuple[float, int]]] = {"old": [], "new": []}
        for trial in range(args.trials):
            order = (old_check_in, new_check_in) if trial % 2 == 0 else (new_check_in, old_check_in)
            for method in order:
                runs[method.__name__.split("_")[0]].append(one_run(server, world, method, args.timeout))
        t_old = statistics.median(t for t, _ in runs["old"])
        t_new = statistics.median(t for t, _ in runs["new"])
        r_old = statistics.median(n for _, n in runs["old"])
        r_new = statistics.median(n for _, n in runs["new"])
        print(f"{world:>6} {t_old:>9.3f} {t_new:>8.3f} {t_old / t_new:>12.1f} {r_old:>13.0f} {r_new:>13.0f} "
              f"{r_old / r_new:>16.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

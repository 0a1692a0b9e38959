"""The end of a job in its store: each rank checks out; a working rank beats; rank 0, the store's
server, leaves once every rank has checked out, or has stopped beating.

Per rank a check-out and a beat are one request of a few bytes. Rank 0 alone reads every rank's
check-out (one wait over all of them), and reads beats only of ranks that are late.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from hpcdist.errors import cause_text
from hpcdist.runtime import signed_store
from hpcdist.runtime.checkin import _missing, _rank_keys, _ranks
from hpcdist.runtime.rankinfo import RankInfo

if TYPE_CHECKING:
    from hpcdist.runtime.checkin import Store

log = logging.getLogger("hpcdist")
BEAT_WATCH_S = 3.0  # how long rank 0 watches a missing rank's beat key: three of the watchdog's beats


def check_out(store: Store, info: RankInfo, failed: bool = False) -> None:
    """This rank is done (or failed: it will not finish), so rank 0 need not wait for it."""
    store.set(f"hpcdist/done/{info.rank}", "failed" if failed else "1")


def beat(store: Store, info: RankInfo) -> None:
    """This rank is alive and working: rank 0's end-of-job wait goes on while its beat changes (a
    signed value, not a counter: a forged beat is ignored)."""
    store.set(f"hpcdist/beat/{info.rank}", str(time.monotonic_ns()))


def finish(store: Store, info: RankInfo, timeout: float) -> list[int]:
    """A last check-out so rank 0 (the store's server) leaves only after every rank is done.

    Rank 0 waits in rounds of `timeout` for every rank's signed check-out. After a round, it
    watches the beat of each rank still missing (``watch_beat``): a rank that is still working
    (a genuine beat newer than the one read when the round ended, as the python job's watchdog
    writes every second) is waited for, however long it takes, up to the job's own time limit,
    since closing the store would stop it. Beats someone else writes back, forges or deletes
    neither keep rank 0 waiting nor hide a genuine beat written during the watch (said in the log).
    A rank with no genuine new beat during the watch is given up on: rank 0 leaves anyway, the
    job's work being done and only the farewell late, but says so: a warning names the ranks that
    never checked out, which are returned.
    """
    check_out(store, info)
    if not info.is_main:
        return []
    done = _rank_keys("hpcdist/done", info.world_size)
    seen: dict[int, bytes | None] = {}  # the last beat read of each late rank
    while True:
        try:
            store.wait(done, timedelta(seconds=timeout))
            return []
        except Exception as exc:  # noqa: BLE001 - timed out (the server is this process)
            missing = _missing(store, done) or []
            for r in missing:
                if r not in seen:  # its beat as the round ended: only a newer one is a sign of life
                    seen[r] = signed_store.signed(store).look(f"hpcdist/beat/{r}")[0]
            signs = {r: watch_beat(signed_store.signed(store), r, seen) for r in missing}
            tampered = [r for r in missing if signs[r] == "tampered"]
            if tampered:
                log.warning("check-out: the beat of rank(s) %s was written by someone else in the job's store (old "
                            "beats written back, forged or deleted): no sign of life, and none of death",
                            _ranks(tampered))
            alive = [r for r in missing if signs[r] == "working"]
            if alive:
                log.info("check-out: rank(s) %s still working after rank 0 finished; waiting for them",
                         _ranks(alive))
                continue
            still = _missing(store, done)  # a rank may have checked out while rank 0 watched its beat
            missing = missing if still is None else [r for r in missing if r in still]
            if not missing:
                return []
            log.warning(
                "check-out: rank(s) %s of %d did not check out within %g s (%s); rank 0 leaves anyway, "
                "their store connections close now: see their logs", _ranks(missing) or "?", info.world_size,
                timeout, cause_text(exc),
            )
            return missing


def watch_beat(store: signed_store.SignedStore, rank: int, seen: dict[int, bytes | None],
               watch_s: float = BEAT_WATCH_S) -> str:
    """Whether `rank` beat since rank 0 last read its beat (`seen`, updated): "working" (a genuine
    beat newer than the last one read), "tampered" (within `watch_s` the key was written, but only
    with values that are no newer genuine beat: replayed, forged, or deleted at once), or "silent"
    (nobody wrote it).

    Rank 0 takes each value it reads out of the store and waits for the key to be written again: a
    store wait wakes at every write, and rank 0 reads at once, so a rank that beats is seen even
    when someone writes old beats back or deletes them; and beats written back are no sign of life."""
    key = f"hpcdist/beat/{rank}"
    written = False
    deadline = time.monotonic() + watch_s
    while True:
        now, _ = store.look(key)
        if now is not None and now != seen.get(rank):
            seen[rank] = now
            return "working"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        store.plain.delete_key(key)  # consumed: only a write after this wakes the wait below
        try:
            store.plain.wait([key], timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - torch's wait timeout: no write since
            break
        written = True
    return "tampered" if written else "silent"

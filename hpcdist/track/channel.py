"""One background thread per tracker: the training step only appends to a list; the thread sends.

A tracker that fails (a server down, a slow link) keeps its items and is tried again every few
seconds; the job sees one warning per minute while it fails and one when it is back. At the end
the thread gets a bounded time to send the rest; what is still unsent then is said, never waited
for. The HDF5 result, written by the job itself, has every metric in any case.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from hpcdist.track.base import Item, Tracker, write_high_water

log = logging.getLogger("hpcdist")

RETRY_S = 2.0  # between tries of a failing tracker
WARN_EVERY_S = 60.0  # at most one warning per tracker this often
MAX_PENDING = 200_000  # items kept for a tracker that is down; the oldest metrics go first past it


class Channel:
    """Items for one tracker, sent by its own daemon thread."""

    def __init__(self, tracker: Tracker, folder: Path, every_s: float = 1.0, warn_every_s: float = WARN_EVERY_S,
                 taken: int | None = None):
        self.tracker, self.folder = tracker, folder
        self.taken = taken  # the last step the tracker took before this start (its high-water mark)
        self.every_s, self.warn_every_s = every_s, warn_every_s
        self._pending: list[Item] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_warning = -float("inf")
        self._failing = False
        self.dropped = 0
        self.warnings = 0
        self.high_water: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"hpcdist-track-{tracker.name}", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def put(self, item: Item) -> None:
        with self._lock:
            self._pending.append(item)
            if len(self._pending) > MAX_PENDING:
                del self._pending[0]
                self.dropped += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(RETRY_S if self._failing else self.every_s)
            self._wake.clear()
            self._flush()

    def _flush(self) -> bool:
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return True
        try:
            self.tracker.send(batch)
        except Exception as exc:  # any failure of the tracker's client: keep the items, say so now and then
            with self._lock:
                self._pending[:0] = batch
            self._failing = True
            self._warn(exc)
            return False
        if self._failing:
            log.warning("tracking: %s takes metrics again", self.tracker.name)
        self._failing = False
        steps = [i.step for i in batch if i.what == "metrics"]
        if steps:
            self.high_water = max(steps)
            try:
                write_high_water(self.folder, self.tracker.name, self.high_water)
            except OSError as exc:
                self._warn(exc)
        return True

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning < self.warn_every_s:
            return
        self._last_warning = now
        self.warnings += 1
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        log.warning("tracking: %s is not taking metrics (%s: %s); the job goes on, %d item(s) kept to send later, "
                    "every metric is in the job's result file", self.tracker.name, type(exc).__name__, first,
                    len(self._pending))

    def close(self, finished: bool) -> threading.Event:
        """Stop the thread after one last send, then the tracker's own end (flush, run state), in a
        thread of its own; the event is set once it is done (``Run.close`` bounds the wait)."""
        done = threading.Event()

        def last() -> None:
            self._stop.set()
            self._wake.set()
            self._thread.join()
            if self._flush():
                try:
                    self.tracker.finish(finished)
                except Exception as exc:
                    self._warn(exc)
            done.set()

        threading.Thread(target=last, name=f"hpcdist-track-{self.tracker.name}-close", daemon=True).start()
        return done

    def say_unsent(self, timeout_s: float) -> None:
        log.warning("tracking: %s did not take the last %d item(s) within %.0f s; they are in the job's "
                    "result file only", self.tracker.name, len(self._pending), timeout_s)

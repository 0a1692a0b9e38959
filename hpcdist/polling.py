"""Polling against a deadline: the one loop behind every wait that has no callback to block on.

A hang is a bug, so the caller gives a timeout and, when ``poll_until`` returns None, raises its
own error naming the operation and what never arrived (the ranks, the file, the job). Standard
library only: the rendezvous and the submit side both use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(check: Callable[[], T | None], timeout_s: float | None, interval_s: float,
               first_s: float | None = None) -> T | None:
    """`check()` every `interval_s` until it returns something other than None, which is returned;
    None once `timeout_s` seconds have passed (``None``: no deadline). `check` runs at least once,
    and once more after the deadline's last sleep, so a slow last poll is never lost. `first_s`:
    the first wait, doubled at each poll up to `interval_s` (a short job is seen ending at once)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    wait = interval_s if first_s is None else min(first_s, interval_s)
    while True:
        result = check()
        if result is not None:
            return result
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic())))
        wait = min(2 * wait, interval_s)

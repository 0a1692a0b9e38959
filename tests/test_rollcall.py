"""The roll call after a failed collective (``hpcdist.runtime.rollcall``) where its own thread
cannot start."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, cast

import pytest
import torch.distributed as dist

from hpcdist.runtime import rollcall
from hpcdist.runtime.signed_store import SignedStore


def test_a_roll_call_without_a_thread_to_spare_still_names_the_silent_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node at its limit on tasks refuses a new thread ("can't start new thread": 16,384 ranks
    simulated as threads reach this machine's 32,768); the roll call answers in the caller's
    thread and names the silent rank, instead of raising over the failure being reported."""
    started: list[str] = []

    def refuse(self: threading.Thread) -> None:
        started.append(self.name)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    said = rollcall.roll_call(0, ["n1", "n2"], wait_s=0.3, store=dist.HashStore(), verdict_s=1.0)
    assert started == ["hpcdist-roll-call"]
    assert said.startswith("no answer within 0.3 s from n2 (rank 1)"), said


def test_a_roll_call_in_its_own_thread_names_the_silent_rank() -> None:
    """The same roll call with a thread to spare: the same answer."""
    store: Any = dist.HashStore()
    said = rollcall.roll_call(0, ["n1", "n2"], wait_s=0.3, store=store, verdict_s=1.0)
    assert said.startswith("no answer within 0.3 s from n2 (rank 1)"), said


class _Busy:
    """A store that answers a wait only after 0.2 s (a request of 16,384 keys to the simulated
    job's store took longer than the 0.1 s the roll call gave it), counting requests."""

    def __init__(self) -> None:
        self.store: Any = dist.HashStore()
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        self.requests += 1
        return getattr(self.store, name)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.requests += 1
        time.sleep(min(timeout.total_seconds(), 0.2))
        if timeout.total_seconds() < 0.2:
            raise TimeoutError(f"wait of {len(keys)} keys")
        self.store.wait(keys, timeout)


def test_a_busy_store_costs_the_verdicts_maker_a_few_requests_not_one_per_rank() -> None:
    """The rank that makes the verdict reads every answer in one request, however long the store
    takes to answer it; when that read timed out (0.1 s), it read the answers one by one: 16,417
    requests at 16,384 simulated ranks, nine seconds of the roll call."""
    busy = _Busy()
    for r in range(64):
        if r != 17:
            busy.store.set(f"hpcdist/rollcall/{r}", "1")
    assert rollcall._silent(SignedStore(cast(Any, busy), None), 64) == [17]
    assert busy.requests <= 2 * 6 + 3, busy.requests  # the halving around one absent key, then one read

"""The roll call after a failed collective (``hpcdist.runtime.rollcall``) where its own thread
cannot start."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from hpcdist.runtime import rollcall


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


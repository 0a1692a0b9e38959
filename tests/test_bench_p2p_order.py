"""Point to point under NCCL's ordering: a pair's calls run in order on one stream, so a receive
waits until the peer's matching send reaches the head of the peer's queue; calls posted as one
group (``batch_isend_irecv``) progress together. gloo and MPI match out of order and cannot show
a hang, so the two ranks here run on a wire that keeps NCCL's order (two threads, one process)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from hpcdist.bench import p2p
from hpcdist.bench.base import host_timed


@dataclass
class Op:
    kind: str  # "send" or "recv"
    rank: int
    peer: int
    buf: np.ndarray
    done: bool = False


@dataclass
class InOrderWire:
    """Each rank's queue of groups; only the head group of each rank can match."""

    cv: threading.Condition = field(default_factory=threading.Condition)
    queues: dict[int, list[list[Op]]] = field(default_factory=lambda: {0: [], 1: []})

    def post(self, ops: list[Op]) -> list[Op]:
        with self.cv:
            self.queues[ops[0].rank].append(ops)
            self._progress()
            self.cv.notify_all()
        return ops

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            heads = {r: q[0] for r, q in self.queues.items() if q}
            for r, group in heads.items():
                for op in group:
                    other = heads.get(op.peer, [])
                    match = next((o for o in other if not o.done and o.kind != op.kind and o.peer == r), None)
                    if not op.done and op.kind == "send" and match is not None:
                        match.buf[:] = op.buf
                        op.done = match.done = True
                        moved = True
            for q in self.queues.values():
                while q and all(o.done for o in q[0]):
                    q.pop(0)
                    moved = True

    def wait(self, ops: list[Op]) -> None:
        with self.cv:
            if not self.cv.wait_for(lambda: all(o.done for o in ops), timeout=3):
                raise TimeoutError("both ranks wait on receives queued before their own sends")


class InOrderPath:
    """A CommPath whose point-to-point calls keep NCCL's per-pair order."""

    name, label, size = "torch", "torch/in-order", 2

    def __init__(self, wire: InOrderWire, rank: int) -> None:
        self.wire, self.rank = wire, rank

    def bytes_buffer(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    def isend(self, buf: np.ndarray, peer: int) -> list[Op]:
        return self.wire.post([Op("send", self.rank, peer, buf)])

    def irecv(self, buf: np.ndarray, peer: int) -> list[Op]:
        return self.wire.post([Op("recv", self.rank, peer, buf)])

    def send(self, buf: np.ndarray, peer: int) -> None:
        self.wire.wait(self.isend(buf, peer))

    def recv(self, buf: np.ndarray, peer: int) -> None:
        self.wire.wait(self.irecv(buf, peer))

    def wait_all(self, reqs: list[list[Op]]) -> None:
        self.wire.wait([op for r in reqs for op in r])

    def exchange(self, send: np.ndarray, recv: np.ndarray, peer: int, count: int) -> None:
        ops = [Op("recv", self.rank, peer, recv) for _ in range(count)]
        self.wire.wait(self.wire.post(ops + [Op("send", self.rank, peer, send) for _ in range(count)]))

    def sync(self) -> None:
        pass

    def timed(self, step: Any, iters: int) -> np.ndarray:
        return host_timed(step, iters)


@pytest.mark.parametrize("test", ["pingpong", "unidir", "bidir"])
def test_every_p2p_test_finishes_when_calls_run_in_order(test: str) -> None:
    wire = InOrderWire()
    errors: list[BaseException] = []
    done: list[int] = []

    def rank(me: int) -> None:
        try:
            local = p2p.exchange(InOrderPath(wire, me), test, me, 1 - me, me == 0, 64, warmup=1, iters=3,
                                 window=16, check=False)
            assert len(local.times) == 3
            done.append(me)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, f"{test}: {errors[0]}"
    assert sorted(done) == [0, 1]

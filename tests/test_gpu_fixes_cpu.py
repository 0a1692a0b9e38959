"""Three GPU fixes, held by CPU tests: each test fails when its fix is undone (issue 40, item 3).

No GPU here and gloo behaves unlike NCCL, so the parts a CPU run cannot produce are stood in
for: NCCL's per-pair order of point-to-point calls (a wire that matches only the head of each
rank's queue), ``torch.cuda`` (the fixture of tests/test_device.py, plus the current device
and each rank's GPU UUIDs), and the collectives of a group the script made itself. Everything
between them is hpcdist's own code: the benchmark's ``TorchPath``, ``hpcdist.init()`` and the
bootstrap's rendezvous over a real TCPStore.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

import hpcdist
from hpcdist.api.context import forget
from hpcdist.bench import p2p
from hpcdist.bench.torch_path import TorchPath
from hpcdist.config import load_site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import BootstrapError
from hpcdist.runtime import bootstrap, plain, requeue
from tests import test_device
from tests.test_bench_p2p_order import InOrderWire, Op
from tests.test_group import run_ranks

fake_cuda = test_device.fake_cuda  # torch.cuda as a node with fake_cuda["count"] GPUs shows it


@pytest.fixture(autouse=True)
def kept_loggers() -> Iterator[None]:
    """The bootstrap sets up the rank's loggers for the process; this test process keeps its own."""
    logs = [logging.getLogger(n) for n in ("hpcdist", "hpcdist.user")]
    kept = [(log.handlers[:], log.level, log.propagate) for log in logs]
    yield
    for log, (handlers, level, propagate) in zip(logs, kept, strict=True):
        log.handlers[:], log.propagate = handlers, propagate
        log.setLevel(level)


# ---------------------------------------------------------------- 1. the bidirectional exchange


class NcclHang(RuntimeError):
    """What NCCL would do here: wait for ever."""


@dataclass
class NcclWire(InOrderWire):
    """NCCL's order (``InOrderWire``), with a hang reported at once: when every rank waits and no
    waiter's calls can complete, nothing will ever post the call they wait for."""

    waiting: dict[int, list[Op]] = field(default_factory=dict)
    hung: bool = False

    def wait(self, ops: list[Op]) -> None:
        rank = ops[0].rank
        with self.cv:
            self.waiting[rank] = ops
            try:
                while not all(o.done for o in ops):
                    stuck = len(self.waiting) == len(self.queues) and not any(
                        all(o.done for o in w) for w in self.waiting.values())
                    if stuck or self.hung:
                        self.hung = True
                        self.cv.notify_all()
                        raise NcclHang(f"rank {rank} hangs: every rank waits on calls queued behind calls "
                                       f"that NCCL's order will never match")
                    self.cv.wait(timeout=60)  # only a backstop: the hang is found without it
            finally:
                del self.waiting[rank]


class P2POp(NamedTuple):
    op: Any
    tensor: Any
    peer: int


@pytest.fixture
def nccl_p2p(monkeypatch: pytest.MonkeyPatch) -> threading.local:
    """torch.distributed's point-to-point calls for two ranks (threads) on an ``NcclWire``: a
    separate isend/irecv is a group of its own, ``batch_isend_irecv`` posts one group. The
    returned thread-local says which rank a thread is."""
    wire, me = NcclWire(), threading.local()

    @dataclass
    class Work:
        ops: list[Op]

        def wait(self) -> None:
            wire.wait(self.ops)

    def isend(tensor: Any, dst: int, *_: Any, **__: Any) -> Work:  # the wire copies tensors as arrays
        return Work(wire.post([Op("send", me.rank, dst, tensor)]))

    def irecv(tensor: Any, src: int, *_: Any, **__: Any) -> Work:
        return Work(wire.post([Op("recv", me.rank, src, tensor)]))

    def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
        ops = [Op("send" if p.op is isend else "recv", me.rank, p.peer, p.tensor) for p in p2p_op_list]
        return [Work(wire.post(ops))]

    monkeypatch.setattr(dist, "get_rank", lambda group=None: me.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "send", lambda tensor, dst, *a, **k: isend(tensor, dst).wait())
    monkeypatch.setattr(dist, "recv", lambda tensor, src, *a, **k: irecv(tensor, src).wait())
    monkeypatch.setattr(dist, "P2POp", P2POp)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    return me


def test_the_bidirectional_test_of_the_torch_path_finishes_in_nccls_order(nccl_p2p: threading.local) -> None:
    """``bench_p2p``'s bidir on ``torch/nccl``: both ranks post a window of receives and sends to
    each other at once. Posted one by one, each rank's receives wait for sends that the peer
    queued behind its own receives (NVIDIA/nccl#479), and the benchmark hangs; posted as one
    group, both windows complete, and the checked message arrives intact."""
    got: list[Any] = [None, None]

    def rank(me: int) -> None:
        nccl_p2p.rank = me
        path = TorchPath(torch.device("cpu"), "nccl")
        got[me] = p2p.exchange(path, "bidir", me, 1 - me, me == 0, 64, warmup=1, iters=3, window=4, check=True)

    results = run_ranks(2, rank)
    assert results == [None, None], results
    assert [len(g.times) for g in got] == [3, 3] and got[1].wrong == 0


# ---------------------------------------------------------------- 2. hpcdist.init() after the script's own group


def test_init_after_the_scripts_own_nccl_group_runs_its_collectives_on_the_ranks_gpu(
        fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A torchrun-style script makes its NCCL group, without a ``set_device`` of its own, then
    calls ``hpcdist.init()``: local rank 1 of 4, every GPU visible, is ``cuda:1``, and the
    exchanges of plain data ``init`` runs on that group (every rank's host, the run id) must use
    ``cuda:1`` too. Under NCCL they run on the current device: left at ``cuda:0``, every rank
    would put its messages on GPU 0."""
    fake_cuda["count"] = 4

    def current() -> int:  # set_device's last device, cuda:0 before any
        return int(fake_cuda.get("bound", torch.device("cuda", 0)).index)

    monkeypatch.setattr(torch.cuda, "current_device", current)
    seen: list[tuple[str, int]] = []

    def all_gather_plain(value: Any, group: Any = None, device: Any = None, what: str = "") -> list[Any]:
        seen.append(("all_gather_plain", current()))  # device None: plain takes the current one for NCCL
        return [value] * 4

    def broadcast_plain(value: Any, src: int, group: Any = None, device: Any = None, what: str = "") -> Any:
        seen.append(("broadcast_plain", current()))
        return value

    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the script's own init_process_group("nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: object())  # bound to no device
    monkeypatch.setattr(plain, "all_gather_plain", all_gather_plain)
    monkeypatch.setattr(plain, "broadcast_plain", broadcast_plain)
    monkeypatch.setattr(requeue, "watch", lambda names: [])  # the test process keeps its signal handlers
    monkeypatch.setattr("atexit.register", lambda *a, **k: None)
    for var in [v for v in os.environ if v.startswith(("SLURM", "SUBMITIT_", "OMPI_", "PMI", "HPCDIST_",
                                                         "TORCHELASTIC_", "CUDA_VISIBLE_DEVICES"))]:
        monkeypatch.delenv(var)
    for var, value in {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                       "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.chdir(tmp_path)

    ctx = hpcdist.init()
    try:
        assert (ctx.rank, ctx.backend, str(ctx.device)) == (1, "nccl", "cuda:1")
        assert ("all_gather_plain", 1) in seen
        assert all(index == 1 for _, index in seen), f"collectives of plain data on the wrong GPU: {seen}"
    finally:
        forget(ctx)


# ---------------------------------------------------------------- 3. the GPU UUIDs at the check-in


def _bootstrap_ranks(monkeypatch: pytest.MonkeyPatch, fake_cuda: dict[str, Any],
                     visible: list[list[str]]) -> tuple[list[object], dict[int, torch.device]]:
    """``len(visible)`` ranks on one node (threads), rank r seeing the GPUs whose UUIDs are
    ``visible[r]``, each through the bootstrap's rendezvous (a real TCPStore, served as
    torchrun's agent serves it) up to its NCCL group. Returns each rank's device or error, and
    the device each rank's group was bound to."""
    me = threading.local()
    bound: dict[int, torch.device] = {}
    fake_cuda["count"] = len(visible[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=visible[me.rank][i].removeprefix("GPU-")))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kw: bound.__setitem__(kw["rank"], kw["device_id"]))
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    site = load_site("local")
    spec = JobSpec.model_validate({"name": "t", "kind": "python", "backend": "nccl", "timeout_s": 10})
    world = len(visible)

    def rank(r: int) -> torch.device:
        me.rank = r
        # each task sees its own subset of the node's GPUs (as srun --gpu-bind=closest leaves them)
        env = {"TORCHELASTIC_RUN_ID": "none", "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.port), "SLURMD_NODENAME": "gpu08",
               "CUDA_VISIBLE_DEVICES": ",".join(visible[r])}
        return bootstrap.bootstrap(spec, site, env, standalone=True, shared_scratch=False).device

    return run_ranks(world, rank), bound


def test_two_ranks_that_see_one_gpu_are_refused_naming_both(fake_cuda: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node=2``: both ranks see the same GPU, each
    would take its cuda:0. Every rank stops at the rendezvous with hpcdist's one line naming both
    ranks and the GPU, before NCCL's "Duplicate GPU detected" (which names neither)."""
    uuid = "GPU-5b0c8e61-7d2a-4e43-9f10-000000000000"
    results, bound = _bootstrap_ranks(monkeypatch, fake_cuda, [[uuid], [uuid]])
    want = f"ranks 0, 1 were given one GPU ({uuid}) on gpu08: NCCL needs a GPU per rank; bind one GPU per task"
    assert all(isinstance(e, BootstrapError) for e in results), results
    assert all(str(e).startswith(want) and "\n" not in str(e) for e in results), results
    assert bound == {}  # no NCCL group was made


def test_ranks_that_see_a_subset_each_are_placed_on_gpus_of_their_own(fake_cuda: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks on a node of four GPUs, even ranks seeing the first socket's two, odd ranks the
    second's: each alone would take its local rank modulo two, giving ranks 0 and 2 (and 1 and 3)
    one GPU. Placed from every rank's UUIDs, each rank's device, and the device its NCCL group is
    bound to, is a GPU no other rank has."""
    gpu = [f"GPU-5b0c8e61-7d2a-4e43-9f10-00000000000{i}" for i in range(4)]
    visible = [[gpu[0], gpu[2]] if r % 2 == 0 else [gpu[1], gpu[3]] for r in range(4)]
    results, bound = _bootstrap_ranks(monkeypatch, fake_cuda, visible)
    assert all(isinstance(d, torch.device) for d in results), results
    uuids = [visible[r][d.index] for r, d in enumerate(results) if isinstance(d, torch.device) and d.index is not None]
    assert len(set(uuids)) == 4, f"ranks share a GPU: {uuids}"
    assert bound == dict(enumerate(results))

"""Rendezvous in one process (threads stand in for ranks): endpoints, check-in, missing ranks."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from hpcdist.config import load_site
from hpcdist.errors import BootstrapError, ConfigError, cause_text
from hpcdist.runtime import group
from hpcdist.runtime.rankinfo import RankInfo


def info(rank: int, world: int, **kw: object) -> RankInfo:
    base = dict(launcher="slurm", rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                node_rank=0, num_nodes=1, hostname=f"h{rank}", job_id="77")
    base.update(kw)
    return RankInfo(**base)  # type: ignore[arg-type]


def run_ranks(world: int, fn) -> list[object]:  # type: ignore[no-untyped-def]
    out: list[object] = [None] * world

    def target(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            out[r] = exc

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("via", ["file", "hostlist"])
def test_ranks_meet_and_learn_hosts(tmp_path: Path, via: str) -> None:
    rdir = tmp_path if via == "file" else None
    key = f"77.0.{uuid.uuid4().hex[:8]}"  # the host-list path derives its port from the key

    def rank(r: int) -> dict[int, str]:
        me = info(r, 3)
        store, endpoint = group.open_store(me, 10, rendezvous_dir=rdir, key=key)
        assert endpoint.via == via and endpoint.addr == "127.0.0.1"
        hosts = group.check_in(store, me, 10)
        group.finish(store, me, 10)
        return hosts

    results = run_ranks(3, rank)
    assert results == [{0: "h0", 1: "h1", 2: "h2"}] * 3
    if via == "file":  # the published endpoint is a complete file, no temporary left
        assert [p.name for p in tmp_path.iterdir()] == [f"{key}.json"]


def test_missing_rank_is_named_within_timeout(tmp_path: Path) -> None:
    def rank(r: int) -> object:  # ranks 0 and 1 come, rank 2 never does
        me = info(r, 3)
        store, _ = group.open_store(me, 5, rendezvous_dir=tmp_path, key="k")
        return group.check_in(store, me, 1.0)

    results = run_ranks(2, rank)
    for r, result in enumerate(results):
        assert isinstance(result, BootstrapError), result
        assert f"rank(s) 2 of 3 did not join within 1 s (this is rank {r} on h{r})" in str(result)


def test_rank0_that_never_publishes_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BootstrapError, match=r"rank 0 did not publish its address in .* within 0.5 s"):
        group.open_store(info(1, 2), 0.5, rendezvous_dir=tmp_path, key="nobody")


def test_restart_gets_a_fresh_key() -> None:
    me = info(0, 2)
    first = group.rendezvous_key({"SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "0"}, me)
    again = group.rendezvous_key({"SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}, me)
    assert first != again and first.startswith("77.")


def test_gloo_and_nccl_interface_follow_socket_ifname() -> None:
    assert group.socket_ifname_env("eth0") == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert group.socket_ifname_env(None) == {}


def test_site_env_cannot_set_the_socket_interface() -> None:
    with pytest.raises(ConfigError, match=r"NCCL_SOCKET_IFNAME='ib0' is set from network.socket_ifname"):
        load_site("local-slurm", ["env.NCCL_SOCKET_IFNAME=ib0"])


def test_finish_names_the_ranks_that_never_checked_out(caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger("hpcdist"), "propagate", True)
    me = info(0, 3)
    store, _ = group.open_store(me, 5, rendezvous_dir=None, key=f"77.0.{uuid.uuid4().hex[:8]}")
    group.check_out(store, info(2, 3), failed=True)  # rank 2 failed but said so; rank 1 is silent
    with caplog.at_level(logging.WARNING, logger="hpcdist"):
        assert group.finish(store, me, 0.5) == [1]
    assert "check-out: rank(s) 1 of 3 did not check out within 0.5 s" in caplog.text


def test_a_rendezvous_error_keeps_its_cause_in_one_line() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BootstrapError) as caught:
        group.open_store(info(1, 2, master_addr="127.0.0.1", master_port=port), 0.5, rendezvous_dir=None, key="k")
    message = str(caught.value)
    assert "rank 1 could not reach rank 0 at 127.0.0.1:" in message and "\n" not in message
    assert caught.value.__cause__ is not None  # the chain `--debug` prints
    assert cause_text(caught.value.__cause__) in message  # its type and first line, not the type alone
    assert len(cause_text(caught.value.__cause__)) > len(type(caught.value.__cause__).__name__)


def test_a_missing_rank_error_chains_the_store_timeout() -> None:
    key = f"77.0.{uuid.uuid4().hex[:8]}"
    _server, _ = group.open_store(info(0, 3), 5, rendezvous_dir=None, key=key)
    client, _ = group.open_store(info(1, 3), 5, rendezvous_dir=None, key=key)
    missing = r"rank\(s\) 0, 2 of 3 did not join within 1 s \(this is rank 1 on h1\)"
    with pytest.raises(BootstrapError, match=missing) as caught:
        group.check_in(client, info(1, 3), 1.0)
    assert caught.value.__cause__ is not None


MPI_STUCK_RANK0 = """
import time
from mpi4py import MPI
from hpcdist.runtime import group
from hpcdist.runtime.rankinfo import RankInfo
comm = MPI.COMM_WORLD
me = RankInfo.from_env(__import__("os").environ)
if comm.Get_rank() == 0:
    time.sleep(60)  # stuck before publishing: never joins the broadcast
else:
    group._mpi_share(comm, None, me, 2.0)
"""


def test_an_endpoint_that_never_comes_over_mpi_aborts_the_job() -> None:
    """Real `mpirun -n 2`: rank 0 never sends its endpoint; rank 1 stops waiting after the timeout,
    logs why and aborts the MPI job (a broadcast cannot be cancelled, so it is not left behind)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    t0 = time.monotonic()
    proc = subprocess.run(["mpirun", "-n", "2", sys.executable, "-c", MPI_STUCK_RANK0], capture_output=True,
                          text=True, timeout=50, env=env)
    assert proc.returncode != 0
    assert "rendezvous: no endpoint from rank 0 over MPI within 2 s (this is rank 1 on" in proc.stderr, proc.stderr
    assert "aborting the MPI job" in proc.stderr and time.monotonic() - t0 < 40


def _seat_ranks(gpus: list[list[str]], prefer: list[int]) -> list[object]:
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    world = len(gpus)

    def rank(r: int) -> object:
        client = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
        return group.take_seats(client, info(r, world, hostname="gpu08"), 10, gpus[r], prefer[r])[1]

    return run_ranks(world, rank)


def test_two_ranks_given_one_gpu_are_refused_before_nccl_starts() -> None:
    """NCCL's own "Duplicate GPU detected" comes from inside init_process_group, naming CUDA device
    numbers; the check-in compares GPU UUIDs first and every rank raises the same one-line error."""
    results = _seat_ranks([["GPU-aaaa"], ["GPU-bbbb"], ["GPU-aaaa"]], [0, 0, 0])
    want = ("ranks 0, 2 were given one GPU (GPU-aaaa) on gpu08: NCCL needs a GPU per rank; bind one GPU per "
            "task (--gpus-per-task=1 or --gpu-bind) or set tasks_per_node to the GPUs per node")
    assert [str(e) for e in results] == [want] * 3
    assert all(isinstance(e, BootstrapError) for e in results)


def test_tasks_that_see_a_subset_of_the_gpus_each_get_their_own() -> None:
    """--gpu-bind=closest with cyclic tasks: even local ranks see the first socket's four GPUs, odd
    ones the second's. The local rank modulo four (what each task would pick alone) gives ranks 0 and
    4 the same GPU; the check-in places every rank on a GPU of its own."""
    a = [f"GPU-a{i}" for i in range(4)]
    b = [f"GPU-b{i}" for i in range(4)]
    alone = [r % 4 for r in range(8)]
    assert [a[alone[r]] if r % 2 == 0 else b[alone[r]] for r in (0, 4)] == ["GPU-a0", "GPU-a0"]
    placed = _seat_ranks([a if r % 2 == 0 else b for r in range(8)], alone)
    gpus = [(a if r % 2 == 0 else b)[i] for r, i in enumerate(placed)]  # type: ignore[index]
    assert len(set(gpus)) == 8
    assert placed[:4] == [0, 1, 2, 3]  # the first four keep the GPU they would have picked

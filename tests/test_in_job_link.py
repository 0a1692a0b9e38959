"""The line between a job's ranks and its in-job supervisor (hpcdist.runtime.in_job_link), without
a cluster: the rank a process started again alone takes, which failures are its communication's,
what the supervisor reads from a rank, and what it refuses from anyone else on its port. The whole
path runs on the real cluster in tests/test_in_job_restart.py (and the attack by another user in
tests/test_in_job_security.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hpcdist.config.contract import IN_PLACE_VAR
from hpcdist.errors import JobError
from hpcdist.runtime import in_job_link, in_job_port, signed_store
from hpcdist.runtime.in_job_link import RANK, seal
from hpcdist.runtime.in_job_port import Links
from hpcdist.runtime.rankinfo import RankInfo


def test_a_rank_started_again_alone_takes_the_rank_it_replaces() -> None:
    """The second task of a step started for ranks 1 and 3 of a 4-rank job (2 nodes x 2) is rank
    3, the second of node n2, for the bootstrap as for srun --mpi=pmix's variable."""
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0",
           "SLURM_STEP_NODELIST": "n2", "SLURM_JOB_ID": "7", "PMIX_RANK": "1", IN_PLACE_VAR: "1,3;4;n1,n2;2"}
    in_job_link.adopt(env)
    info = RankInfo.from_env(env, hostname="n2")
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (3, 4, 1, 1)
    assert env["PMIX_RANK"] == "3" and env["SLURM_STEP_NODELIST"] == "n1,n2"
    untouched = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    in_job_link.adopt(untouched)  # any other process: as srun started it
    assert untouched == {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}


def test_a_peer_gone_is_a_communication_failure_and_a_bug_is_not() -> None:
    """torch.distributed's own errors (a store's time-out, here a real one), gloo's words, and
    hpcdist's wrapping of them are the communication's; the job's own code is not, whatever its
    exception is called or says: its own I/O's ConnectionError or "Timed out", a class named
    Dist-something (pkg_resources' DistributionNotFound), a plain ValueError."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=0.2))
    with pytest.raises(Exception) as timed_out:
        store.get("never-set")
    assert in_job_link.communication_failure(timed_out.value), type(timed_out.value)
    reset = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.4]:4711: "
                         "Connection reset by peer")
    try:
        try:
            raise reset
        except RuntimeError as exc:
            raise JobError("training step 12 (gradient all_reduce) failed on rank 0 (n2)") from exc
    except JobError as wrapped:
        assert in_job_link.communication_failure(wrapped)

    class DistributionNotFound(Exception):  # pkg_resources' name, not torch's
        pass

    def own_io() -> None:
        raise ConnectionError("[Errno 111] Connection refused: the user's data server")

    with pytest.raises(ConnectionError) as refused:
        own_io()
    assert not in_job_link.communication_failure(refused.value)
    assert not in_job_link.communication_failure(TimeoutError("Timed out reading the user's shard"))
    assert not in_job_link.communication_failure(RuntimeError("Timed out waiting for the user's queue"))
    assert not in_job_link.communication_failure(DistributionNotFound("the 'foo' distribution was not found"))
    assert not in_job_link.communication_failure(ValueError("batch size 7 does not divide 12"))
    assert not in_job_link.communication_failure(KeyError("w"))


KEY = bytes(range(32))


def hello(nonce: str, rank: int, node: str, key: bytes = KEY, step: str = "12") -> bytes:
    return seal(key, nonce, RANK, 0, f"hello {nonce} {step} {rank} {node}")


def lines_of(sock: socket.socket, count: int) -> list[str]:
    """The next `count` lines the supervisor wrote on `sock`."""
    data = b""
    while data.count(b"\n") < count:
        data += sock.recv(256)
    return data.decode().splitlines()[:count]


def pump(links: Links, until: object, restart: int = 1, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not until() and time.monotonic() < deadline:  # type: ignore[operator]
        links.events(0.1, ["n2", "n3", "n4"], restart=restart)


def test_the_supervisor_reads_who_a_rank_is_and_ignores_a_failure_already_answered() -> None:
    """A rank's signed hello names its step, rank and node (a node outside the step's is not
    taken); its failure counts only in the current run (one of an earlier run was told `again`
    already); the supervisor's words come back signed for that connection."""
    links = Links("127.0.0.1", KEY, {"127.0.0.1"})
    host, port = links.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as rank, socket.create_connection((host, int(port))) as stray:
        rank.sendall(hello("a1", 2, "n4") + seal(KEY, "a1", RANK, 1, "failed comm 0"))
        stray.sendall(hello("b2", 0, "n9"))  # a node the step does not have
        pump(links, lambda: len(links.ranks()) >= 1)
        [link] = links.ranks()
        assert (link.rank, link.node, link.failed) == (2, "n4", "")  # run 0's failure: answered by `again 1`
        assert links.steps == {"12"}
        rank.sendall(seal(KEY, "a1", RANK, 2, "failed own 1"))
        pump(links, lambda: link.failed)
        assert link.failed == "own"
        links.tell("stop")
        taken, word = lines_of(rank, 2)
        assert in_job_link.unseal(KEY, "a1", in_job_link.SUPERVISOR, taken, 0) == (1, "hello")  # it was taken
        assert in_job_link.unseal(KEY, "a1", in_job_link.SUPERVISOR, word, 1) == (2, "stop") and link.failed == ""
        assert in_job_link.unseal(KEY, "b2", in_job_link.SUPERVISOR, word, 0) is None  # another connection's
    links.close_all()


def test_forged_replayed_and_idle_connections_steer_nothing(monkeypatch: pytest.MonkeyPatch,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    """What another user on the batch node can send: lines without the key, a hello signed with
    another key, a genuine hello replayed, a genuine line replayed on its connection, connections
    that open and close or never speak. None becomes a rank, a failure or an end; each is said in
    the batch log; connections that never say who they are go after HELLO_S, and past
    MAX_PENDING at once they are closed on arrival."""
    monkeypatch.setattr(in_job_port, "HELLO_S", 0.5)
    links = Links("127.0.0.1", KEY, {"127.0.0.1"})
    host, port = links.address.rsplit(":", 1)
    where = (host, int(port))
    seen: list[object] = []

    def watch(within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            seen.extend(links.events(0.1, ["n2", "n3", "n4"], restart=0))

    genuine = socket.create_connection(where)
    genuine.sendall(hello("c3", 1, "n3") + seal(KEY, "c3", RANK, 1, "failed comm 0"))
    pump(links, lambda: links.ranks() and links.ranks()[0].failed, restart=0)
    [link] = links.ranks()
    link.failed = ""
    seen.clear()
    forgers = [socket.create_connection(where) for _ in range(4)]
    forgers[0].sendall(b"x 1 n2\nfailed comm 99999\n12 1 n2\n")  # the old protocol's words
    forgers[1].sendall(hello("d4", 0, "n2", key=bytes(32)))  # another job's key
    forgers[2].sendall(hello("c3", 1, "n3"))  # the genuine hello, replayed
    forgers[3].close()  # opens and closes
    genuine.sendall(seal(KEY, "c3", RANK, 1, "failed comm 0"))  # a genuine line replayed on its own connection
    watch(1.5)
    assert [r.rank for r in links.ranks()] == [1] and link.failed == "" and not link.done
    assert [(ev[1], ev[2]) for ev in seen] == [(link, None)]  # the genuine connection's bytes; no end, no failure
    flood = [socket.create_connection(where) for _ in range(in_job_port.MAX_PENDING + 8)]
    watch(0.3)
    pending = [k for k in links.sel.get_map().values() if k.fileobj is not links.server and k.data.rank < 0]
    assert len(pending) <= links.max_pending == in_job_port.MAX_PENDING + 1  # one rank may be connecting
    watch(1.0)  # HELLO_S passed: every silent one is gone
    assert len(links.sel.get_map()) == 2  # the listening socket and the genuine rank
    err = capfd.readouterr().err
    assert "said who it is without the job's key" in err and "not signed with the job's key" in err, err
    assert "the job goes on" in err
    for sock in (*forgers, *flood, genuine):
        sock.close()
    links.close_all()


def test_a_connection_from_outside_the_jobs_nodes_is_bounded_tighter() -> None:
    """An address Slurm does not give for the job's nodes may hold at most MAX_FOREIGN waiting
    connections; a rank that connects from one with the job's key is taken (a site's data network)."""
    links = Links("127.0.0.1", KEY, {"10.251.0.11"})  # this host's 127.0.0.1 is no node of the job's
    host, port = links.address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port))) for _ in range(in_job_port.MAX_FOREIGN + 4)]
    pump(links, lambda: False, within=0.5)
    pending = [k for k in links.sel.get_map().values() if k.fileobj is not links.server]
    assert len(pending) == links.max_foreign == in_job_port.MAX_FOREIGN + 1  # one rank may be connecting
    for sock in socks:
        sock.close()
    pump(links, lambda: False, within=0.3)
    with socket.create_connection((host, int(port))) as rank:
        rank.sendall(hello("e5", 0, "n2"))
        pump(links, lambda: links.ranks())
        assert [r.rank for r in links.ranks()] == [0] and links.known == {"10.251.0.11", "127.0.0.1"}
    links.close_all()


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A job folder holding job 77's key, and a rank's environment naming a supervisor."""
    signed_store.make_key(tmp_path, "77")
    yield str(tmp_path), {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURMD_NODENAME": "n3"}
    for line in in_job_link._KEPT:
        line.sock.close()
    in_job_link._KEPT.clear()
    while not in_job_link._ANSWERS.empty():
        in_job_link._ANSWERS.get_nowait()


def test_a_rank_and_its_supervisor_speak_on_the_jobs_key(keyed: tuple[str, dict[str, str]]) -> None:
    """Both ends as the job runs them: the rank reads the job's key file and reports in, the
    supervisor (holding the same key) takes it, the rank's failure reaches it, and its `again 4`
    is the restart number the rank runs under."""
    folder, env = keyed
    key = in_job_link.job_key(folder, env)
    assert key is not None and len(key) == 32
    links = Links("127.0.0.1", key, {"127.0.0.1"})
    reporting = threading.Thread(target=in_job_link.report_in,
                                 args=(folder, {**env, "HPCDIST_SUPERVISOR": links.address}))
    reporting.start()  # it waits for the supervisor's hello, which the pump sends
    pump(links, lambda: links.ranks() and not reporting.is_alive(), within=10)
    assert in_job_link.supervised()
    [link] = links.ranks()
    assert (link.rank, link.node) == (1, "n3")
    links.tell("again 4")
    assert in_job_link.again(True, 0) == 4
    pump(links, lambda: link.failed, restart=0)
    assert link.failed == "comm"
    links.close_all()


def test_the_restart_budget_is_a_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """preemption.in_job_restarts_per_hour: 2 restarts use up the hour; once they are older than
    the window (an hour; 0.3 s here) the job may restart again, so a long job with a fault a day
    never runs out."""
    from hpcdist.runtime import in_job_faults

    monkeypatch.setattr(in_job_faults, "HOUR_S", 0.3)
    budget = in_job_faults.Budget(2)
    for _ in range(2):
        assert budget.allows()
        budget.take()
    assert not budget.allows() and "2 of the 2 an hour" in budget.line()
    time.sleep(0.35)
    assert budget.allows() and budget.taken == 2


def test_the_kept_copy_is_one_per_node_and_none_where_it_would_not_fit(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """on_rank_failure: in_place keeps the last saved state in host memory: on a node's local rank
    0 only, the copy of the step before dropped first, and none (said once) where it would take
    more than half of what the node has free."""
    import logging

    import torch

    from hpcdist.api import kept
    from hpcdist.config.contract import KEEP_STATE_VAR
    from hpcdist.store import hostmem

    monkeypatch.setenv(KEEP_STATE_VAR, "1")
    monkeypatch.setattr(kept, "_KEPT", {})
    log = logging.getLogger("test-kept")
    state = {"w": torch.ones(1000, dtype=torch.float64)}  # 8 kB
    kept.keep("ckpt", 3, state, 1, log)
    assert kept._KEPT == {}  # local rank 1: its node's rank 0 keeps it
    kept.keep("ckpt", 3, state, 0, log)
    state["w"] += 1  # training goes on: the copy is the state as saved
    assert kept._KEPT["ckpt"][0] == 3 and float(kept._KEPT["ckpt"][1]["w"].sum()) == 1000.0
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 10_000)  # 8 kB > half of 10 kB
    with caplog.at_level(logging.WARNING, logger="test-kept"):
        kept.keep("ckpt", 4, state, 0, log)
        kept.keep("ckpt", 5, state, 0, log)
    assert "ckpt" not in kept._KEPT  # step 3's copy dropped, step 4's not made
    assert [r.getMessage() for r in caplog.records].count(
        "checkpoint state of 0.0 GB not kept in memory for an in-place restart: the node has 0.0 GB free; a rank "
        "started again reads it from the storage") == 1


def test_a_rank_turned_away_by_a_flood_connects_again(keyed: tuple[str, dict[str, str]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user holds every waiting place of the supervisor's port: the rank's first
    connection is closed unanswered. It connects again a second later, once the idle ones were
    dropped (HELLO_S), and is taken."""
    monkeypatch.setattr(in_job_port, "HELLO_S", 0.5)
    folder, env = keyed
    key = in_job_link.job_key(folder, env)
    assert key is not None
    links = Links("127.0.0.1", key, {"127.0.0.1"})
    host, port = links.address.rsplit(":", 1)
    flood = [socket.create_connection((host, int(port))) for _ in range(links.max_pending)]
    pump(links, lambda: False, within=0.2)
    reporting = threading.Thread(target=in_job_link.report_in,
                                 args=(folder, {**env, "HPCDIST_SUPERVISOR": links.address}))
    reporting.start()
    pump(links, lambda: links.ranks() and not reporting.is_alive(), within=10)
    assert [r.rank for r in links.ranks()] == [1] and in_job_link.supervised()
    assert links.refused >= 1  # its first connection, closed past the bound
    for sock in flood:
        sock.close()
    links.close_all()

"""hpcdist's messages in the rendezvous store carry an HMAC (``hpcdist.runtime.signed_store``): an
altered value, a value moved to another key or another launch, one signed with another job's key
are refused and logged; a forgery set first never blocks the genuine message. Real TCPStores, one
process, no users (tests/test_shared_site_store.py runs the attack as another user)."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hpcdist.config.paths import job_key
from hpcdist.errors import BootstrapError
from hpcdist.runtime import group, signed_store
from hpcdist.runtime.rankinfo import RankInfo
from hpcdist.runtime.signed_store import SignedStore

PREFIX = "hpcdist/77.0.0.0"


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)


def client(server: dist.TCPStore) -> dist.TCPStore:
    """Another connection to the store: a rank, or someone else who reached the port."""
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


def job(server: dist.TCPStore, secret: bytes = b"k" * 32, prefix: str = PREFIX) -> SignedStore:
    return SignedStore(dist.PrefixStore(prefix, client(server)), secret, prefix)


def settled(*stores: dist.Store | SignedStore) -> None:
    """A round trip on each store's own connection: the server has taken what it sent before. A
    TCPStore's set is not answered, so a read on another connection could come first."""
    for store in stores:
        signed_store.plain(store).check(["settled"])


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The warnings hpcdist logs, as they are logged (from any thread)."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("hpcdist").addHandler(handler)
    yield said
    logging.getLogger("hpcdist").removeHandler(handler)


def test_altered_moved_and_replayed_values_are_refused(server: dist.TCPStore, warnings: list[str]) -> None:
    mine, intruder = job(server), client(server)
    mine.set("hpcdist/hosts", json.dumps(["n1", "n2"]))
    assert json.loads(mine.get("hpcdist/hosts")) == ["n1", "n2"]
    genuine = intruder.get(f"{PREFIX}/hpcdist/hosts")
    assert b"k" * 8 not in genuine and len(genuine) == 64 + 32 + len(json.dumps(["n1", "n2"]))  # MAC, writer, sequence

    intruder.set(f"{PREFIX}/hpcdist/hosts", genuine.replace(b"n2", b"ev"))  # altered
    intruder.set(f"{PREFIX}/hpcdist/failed", genuine)  # a genuine value moved to another key
    job(server, prefix="hpcdist/77.0.1.0").set("hpcdist/join/1", "n1")  # another launch (a requeue) of the job
    intruder.set(f"{PREFIX}/hpcdist/join/1", intruder.get("hpcdist/77.0.1.0/hpcdist/join/1"))
    other_job = job(server, secret=b"o" * 32)
    other_job.set("hpcdist/join/0", "evil")  # signed with another job's key
    settled(intruder, other_job)
    for key in ("hpcdist/hosts", "hpcdist/failed", "hpcdist/join/1", "hpcdist/join/0"):
        assert mine.peek(key) is None and not mine.check([key]), key
        assert sum(f"ignored a forged or altered value of {PREFIX}/{key} in the job's store" in w
                   for w in warnings) == 1, (key, warnings)  # once per value, however often it is read
    with pytest.raises(TimeoutError, match=f"no genuine value of {PREFIX}/hpcdist/hosts within 0.3 s"):
        mine.wait(["hpcdist/hosts"], timedelta(seconds=0.3))
    assert not any("k" * 8 in w for w in warnings)


def test_a_forgery_set_first_never_blocks_the_genuine_message(server: dist.TCPStore, warnings: list[str]) -> None:
    reader, writer, intruder = job(server), job(server), client(server)
    intruder.set(f"{PREFIX}/hpcdist/hosts", '["evil"]')
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: (reader.wait(["hpcdist/hosts"], timedelta(seconds=10)),
                                              got.append(reader.get("hpcdist/hosts"))))
    thread.start()
    while not warnings:  # the reader has read the forgery and waits on: now the genuine value comes
        thread.join(0.01)
        assert thread.is_alive()
    writer.set("hpcdist/hosts", '["n1"]')
    thread.join(10)
    assert got == [b'["n1"]']


def test_the_first_genuine_failure_wins_and_a_forged_one_is_replaced(server: dist.TCPStore) -> None:
    rank1, rank2, intruder = job(server), job(server), client(server)
    intruder.set(f"{PREFIX}/hpcdist/failed", "rank 0 on n1: forged")
    settled(intruder)
    assert rank1.compare_set("hpcdist/failed", "", "rank 1 on n2: boom") == b"rank 1 on n2: boom"
    assert rank2.compare_set("hpcdist/failed", "", "rank 2 on n3: later") == b"rank 1 on n2: boom"
    assert rank2.peek("hpcdist/failed") == b"rank 1 on n2: boom"


def test_counters_and_an_unsigned_store_pass_through(server: dist.TCPStore) -> None:
    plain = SignedStore(dist.PrefixStore(PREFIX, client(server)), None, PREFIX)
    plain.set("a", "1")
    assert client(server).get(f"{PREFIX}/a") == b"1" and plain.get("a") == b"1"
    assert job(server).add("hpcdist/joined", 2) == 2 and plain.add("hpcdist/joined", 1) == 3
    assert plain.peek("absent") is None and plain.compare_set("b", "", "x") == b"x"


def test_the_key_file_is_the_users_own_0600_file(tmp_path: Path) -> None:
    folder = tmp_path / "logs" / "smoke" / "812"
    path = signed_store.place_key(signed_store.new_key(tmp_path / "logs" / "smoke"), folder, "812")
    assert path == job_key(folder, "812") == folder / "812_store.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not list((tmp_path / "logs" / "smoke").glob(".*"))
    key = signed_store.read_key(path)
    assert key is not None and len(key) == 32 and key.hex() == path.read_text()
    env = {"SUBMITIT_FOLDER": str(tmp_path / "logs" / "smoke" / "%j")}
    assert signed_store.key_file(env, "812") == path and signed_store.key_file({}, "812") is None
    assert signed_store.read_key(folder / "9_store.key") is None  # not there (yet)
    os.chmod(path, 0o640)
    with pytest.raises(BootstrapError, match=r"store key: refusing to read .*812_store.key: .* it must be 0600"):
        signed_store.read_key(path)


def _info(rank: int, world: int = 2) -> RankInfo:
    return RankInfo(launcher="slurm", rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                    node_rank=0, num_nodes=1, hostname=f"h{rank}", job_id="77")


@pytest.mark.parametrize("keyed", [True, False])
def test_no_key_name_holds_the_secret(tmp_path: Path, keyed: bool) -> None:
    """The job's key file, or else rank 0's key sent in the 0600 endpoint file: never in a key name
    (the nonce that was, and `list_keys()` showed to anyone)."""
    key = signed_store.make_key(tmp_path / "job", "77") if keyed else None
    rdir = tmp_path / "rendezvous"
    stores: dict[int, SignedStore] = {}
    sent: list[dict[str, object]] = []

    def rank(r: int) -> None:
        store, _ = group.open_store(_info(r), 10, rendezvous_dir=rdir, key="77.0.0.0", key_file=key)
        if r == 0:
            sent.append(json.loads((rdir / "77.0.0.0.json").read_text()))
        stores[r] = store
        group.check_in(store, _info(r), 10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    secret = stores[0].secret
    assert secret is not None and stores[1].secret == secret
    assert ("keyed" in sent[0]) == keyed and ("nonce" in sent[0]) != keyed
    names = client_of(stores[0]).list_keys()
    assert any(n.endswith("hpcdist/joined/all") for n in names)
    assert all(secret.hex() not in n and n.startswith(f"{PREFIX}/") for n in names), names


def client_of(store: SignedStore) -> dist.TCPStore:
    return store.plain.underlying_store  # type: ignore[no-any-return]


def test_a_forged_seat_and_count_before_a_rank_joins_do_not_change_the_roll(server: dist.TCPStore,
                                                                            warnings: list[str]) -> None:
    """The intruder sets rank 1's seat and bumps the count before rank 1 arrives: rank 0, seeing the
    count complete, reads the seats, ignores the forged one and waits for rank 1's own."""
    intruder = client(server)
    intruder.set(f"{PREFIX}/hpcdist/join/1", "evil")
    intruder.add(f"{PREFIX}/hpcdist/joined", 1)
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        got[r] = group.check_in(job(server), _info(r), 10)

    first = threading.Thread(target=rank, args=(0,))
    first.start()
    while not any("hpcdist/join/1" in w for w in warnings):
        first.join(0.01)
        assert first.is_alive()
    rank(1)
    first.join(10)
    assert got == {0: {0: "h0", 1: "h1"}, 1: {0: "h0", 1: "h1"}}


def test_a_forged_roll_call_answer_does_not_hide_a_silent_rank(server: dist.TCPStore) -> None:
    from hpcdist.runtime.rollcall import roll_call

    someone = client(server)
    someone.set(f"{PREFIX}/hpcdist/rollcall/1", "1")  # "n2 answered", says someone else
    settled(someone)
    said = roll_call(0, ["n1", "n2"], wait_s=0.3, store=job(server))
    assert said.startswith("no answer within 0.3 s from n2 (rank 1)"), said


def test_a_replayed_value_is_refused_once_a_newer_one_was_read(server: dist.TCPStore, warnings: list[str]) -> None:
    """Every signed value carries its writer's sequence: an earlier genuine value written back over
    a newer one the reader has read is refused, logged once, and reads as absent."""
    rank1, rank0, intruder = job(server), job(server), client(server)
    rank1.set("hpcdist/beat/1", "100")
    old = intruder.get(f"{PREFIX}/hpcdist/beat/1")
    rank1.set("hpcdist/beat/1", "200")
    settled(rank1)
    assert rank0.peek("hpcdist/beat/1") == b"200" and rank0.peek("hpcdist/beat/1") == b"200"  # re-read: no replay
    intruder.set(f"{PREFIX}/hpcdist/beat/1", old)
    settled(intruder)
    assert rank0.peek("hpcdist/beat/1") is None and rank0.look("hpcdist/beat/1") == (None, True)
    assert sum(f"ignored a replayed value of {PREFIX}/hpcdist/beat/1" in w for w in warnings) == 1, warnings
    rank1.set("hpcdist/beat/1", "300")
    settled(rank1)
    assert rank0.peek("hpcdist/beat/1") == b"300"


CAROL = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
port, key, values = int(sys.argv[1]), sys.argv[2], [bytes.fromhex(v) for v in sys.argv[3:]]
carol = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
print("ready", flush=True)
i = 0
while True:
    carol.set(key, values[i % len(values)])
    i += 1
    time.sleep(0.01)
"""


@contextmanager
def _replaying(server: dist.TCPStore, key: str, values: list[bytes]) -> Iterator[None]:
    """carol, another process on the store's port, writes `values` (genuine ones she read earlier)
    back to `key` in turn, every 10 ms."""
    carol = subprocess.Popen([sys.executable, "-c", CAROL, str(server.port), f"{PREFIX}/{key}",
                              *(v.hex() for v in values)], stdout=subprocess.PIPE, text=True)
    try:
        assert carol.stdout is not None and carol.stdout.readline().strip() == "ready"
        yield
    finally:
        carol.kill()
        carol.wait(10)


def _recorded_beats(server: dist.TCPStore, beating: SignedStore, n: int) -> list[bytes]:
    """`n` genuine beats of rank 1, as carol reads them off the store."""
    out = []
    for _ in range(n):
        group.beat(beating, _info(1))
        out.append(client(server).get(f"{PREFIX}/hpcdist/beat/1"))
    return out


def test_replayed_beats_do_not_keep_rank_0_waiting_for_a_dead_rank(server: dist.TCPStore,
                                                                    warnings: list[str]) -> None:
    """Rank 1 beat, then died without checking out; carol writes its earlier beats back in turn:
    rank 0 still leaves after a round and a short watch, naming rank 1 (not at the job's time limit)."""
    import time

    rank0 = job(server)
    beats = _recorded_beats(server, job(server), 3)
    with _replaying(server, "hpcdist/beat/1", beats):
        t0 = time.monotonic()
        result: list[list[int]] = []
        thread = threading.Thread(target=lambda: result.append(group.finish(rank0, _info(0), 0.3)), daemon=True)
        thread.start()
        thread.join(15)
        assert result == [[1]], "rank 0 still waits for dead rank 1 while carol replays its beats"
        assert time.monotonic() - t0 < 15
    assert any("ignored a replayed value" in w and "hpcdist/beat/1" in w for w in warnings), warnings


def test_a_replayed_beat_does_not_make_rank_0_leave_a_rank_still_working(server: dist.TCPStore) -> None:
    """Rank 1 still works (beats every 0.2 s); carol writes its first beat back over every new one:
    rank 0 waits until rank 1 checks out instead of leaving and closing the store under it."""
    rank0, rank1 = job(server), job(server)
    first = _recorded_beats(server, rank1, 1)
    working = threading.Event()

    def rank1_works() -> None:
        while not working.wait(0.2):
            group.beat(rank1, _info(1))
        group.check_out(rank1, _info(1))

    worker = threading.Thread(target=rank1_works, daemon=True)
    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.append(group.finish(rank0, _info(0), 0.3)), daemon=True)
    with _replaying(server, "hpcdist/beat/1", first):
        worker.start()
        thread.start()
        thread.join(4)  # several rounds of 0.3 s under carol's replays
        working.set()  # rank 1 is done now
        thread.join(15)
    worker.join(5)
    assert result == [[]], "rank 0 left while rank 1 was still working"

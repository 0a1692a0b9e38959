"""Issue 41, item 4: a user outside the group at a member's rendezvous store. torch's store answers
anyone who reaches its port, `list_keys()` included; hpcdist's own messages there carry an HMAC
with the job's key (a 0600 file in the member's job folder), so what carol writes under their
names is logged and ignored, and alice's job goes on. Run as the test bed's ordinary users."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO, job_id
from tests.support.members import GROUP_ROOT, as_user, finish, require_members, spawn

ENDPOINT = re.compile(r"group ready: .* endpoint (\d+\.\d+\.\d+\.\d+):(\d+) via")


@pytest.fixture
def name() -> Iterator[str]:
    """The job's name, and a folder every user can see for the test's go-ahead; both go afterwards."""
    tag = uuid.uuid4().hex[:6]
    yield f"store-{tag}"
    for folder in [*GROUP_ROOT.glob(f"*/*/store-{tag}"), Path(f"/var/tmp/hpcdist-store-{tag}")]:
        shutil.rmtree(folder, ignore_errors=True)


def _endpoint(logs: Path, deadline_s: float) -> tuple[str, str, Path]:
    """Rank 0's store address, from its log (the group is ready, its keys are set), and the log."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for log in logs.rglob("*_0_log.*"):
            found = ENDPOINT.search(log.read_text(errors="replace"))
            if found:
                return found.group(1), found.group(2), log
        time.sleep(0.2)
    raise AssertionError(f"no rank 0 log with its store endpoint under {logs} within {deadline_s:g} s")


@pytest.mark.slurm
def test_an_outsider_who_reaches_the_store_cannot_stop_the_job(name: str) -> None:
    from tests.support.cli import require_slurm

    require_slurm()
    require_members()
    go = Path(f"/var/tmp/{name.replace('store-', 'hpcdist-store-')}") / "go"
    go.parent.mkdir(mode=0o755)
    alice = spawn("alice", "-m", "hpcdist.cli", "submit", "--site", "local-group", "--set", "resources.nodes=2",
                  "--set", f"name={name}", "--wait", "--", str(REPO / "tests" / "scripts" / "store_victim.py"),
                  str(go))
    try:
        addr, port, rank0_log = _endpoint(GROUP_ROOT / "logs" / "alice" / name, 120)
        carol = as_user("carol", str(REPO / "tests" / "scripts" / "store_forger.py"), addr, port, timeout=60)
    finally:
        go.touch()  # the job goes on whatever carol did
    run = finish(alice, timeout=90)
    assert carol.code == 0, carol.text  # she reached the store, listed its keys and wrote hers
    names = json.loads(carol.out.strip().splitlines()[-1])
    assert run.code == 0 and "2/2 ranks succeeded" in run.out, run.text + carol.text
    folder = rank0_log.parent
    logs = "".join(p.read_text(errors="replace") for p in folder.glob("*_log.*"))
    assert "carol says stop" not in run.text + logs
    # every rank's watchdog polls the failure key: each says once what it ignored (the host table and
    # the seat are read during the rendezvous only, before carol could list a key)
    ignored = re.findall(r"\[rank (\d)/2 .*ignored a forged or altered value of hpcdist/\S+/hpcdist/failed in the "
                         r"job's store", logs)
    assert sorted(ignored) == ["0", "1"], logs
    # the key that signs alice's messages: hers alone, in her job folder, in no key name carol listed
    jid = job_id(run.out)
    key_file = folder / f"{jid}_store.key"
    assert key_file.owner() == "alice" and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    secret = key_file.read_text()
    assert not any(secret in n for n in names) and any(n.endswith("/hpcdist/join/0") for n in names), names
    assert as_user("carol", "-c", f"open({str(key_file)!r}).read()").code != 0
    assert as_user("bob", "-c", f"open({str(key_file)!r}).read()").code != 0


def _text(pattern: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in pattern.parent.glob(pattern.name))


@pytest.mark.slurm
def test_an_outsider_who_deletes_roll_call_answers_gets_no_healthy_node_marked(name: str) -> None:
    """Issue 54, item 11. alice's 3-node benchmark times out because its rank on n3 hangs (stopped
    by the test); ranks 0 and 1 answer the roll call that follows. carol, outside the group, keeps
    deleting rank 1's answer from the store, so rank 0 reads n2 as silent as n3. Silence is not
    evidence: neither node is marked (both still answer on the network, and Slurm says both
    respond), rank 0 says so in its log, and the job ends FAILED with n3's rank named."""
    import os
    import signal

    from hpcdist.config import load_site
    from hpcdist.store.records import health
    from tests.support.cli import rank_pids, require_slurm, sacct_state
    from tests.support.train import wait_for

    require_slurm()
    require_members()
    root, stop = Path(f"/var/tmp/hpcdist-store-{name.removeprefix('store-')}"), None
    root.mkdir(mode=0o755)
    own = root / "alice"  # her storage, hers alone: the health record this job writes is the test's
    own.mkdir(mode=0o700)
    shutil.chown(own, "alice", "alice")
    sets = [f"site.storage.{k}={own / k}" for k in ("results", "checkpoints", "scratch", "logs")]
    alice = spawn("alice", "-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "bench_collectives.yaml"),
                  "--site", "local-group", "--wait", *(a for s in [
                      *sets, f"name={name}", "resources.nodes=3", "resources.tasks_per_node=1", "timeout_s=10",
                      "params.ops=[all_reduce]", "params.paths=[torch]", "params.modes=[in_place]",
                      "params.min_bytes=1K", "params.max_bytes=1K", "params.iters=100000"] for a in ("--set", s)))
    stopped = 0
    try:
        addr, port, rank0_log = _endpoint(own / "logs", 120)
        stop = root / "stop"
        carol = spawn("carol", str(REPO / "tests" / "scripts" / "store_deleter.py"), addr, port, str(stop))
        time.sleep(2)  # she has listed the keys and is deleting
        stopped = wait_for(lambda: rank_pids(name).get(2), 30, "rank 2's process")
        os.kill(stopped, signal.SIGSTOP)  # n3's rank hangs: ranks 0 and 1 time out in 10 s
        logs = rank0_log.parent
        wait_for(lambda: all(f"failed on rank {r} (n{r + 1})" in _text(logs / f"*_{r}_log.err") for r in (0, 1)),
                 120, "ranks 0 and 1 to fail")
        os.kill(stopped, signal.SIGCONT)  # a rank that hangs still has its watchdog, which ends it
        run = finish(alice, timeout=120)
    finally:
        if stop is not None:
            stop.touch()
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        if alice.poll() is None:
            alice.kill()
    said = finish(carol, timeout=60)
    assert said.code == 0 and json.loads(said.out.strip().splitlines()[-1])["deleted"] > 0, said.text
    assert run.code == 1 and sacct_state(job_id(run.out)) == "FAILED", run.text
    assert re.search(r"rank 0: FAILED BenchmarkError: all_reduce .* failed on rank 0 \(n1\): .*Timed out.*"
                     r"no answer within 5 s from .*n3 \(rank 2\)", run.out), run.text
    site = load_site("local-group", [s.removeprefix("site.") for s in sets])
    assert health.marks(site) == [], [(m.node, m.reason) for m in health.marks(site)]
    log0 = _text(logs / "*_0_log.err")
    assert re.search(r"not marking n2 in the node health record: its ranks did not answer the roll call, but "
                     r"Slurm says it responds and its slurmd answers on the network", log0), log0

"""Issue 41, item 4: a user outside the group at a member's rendezvous store. torch's store answers
anyone who reaches its port, `list_keys()` included; hpcdist's own messages there carry an HMAC
with the job's key (a 0600 file in the member's job folder), so what carol writes under their
names is logged and ignored, and alice's job goes on. Run as the test bed's ordinary users."""

from __future__ import annotations

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
        for log in logs.glob("*/*_0_log.*"):
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
    run = finish(alice, timeout=180)
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

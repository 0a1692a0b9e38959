"""What a waiter asks of Slurm (issue 67, item 2), counted, not timed: alice on the Slurm 24.11
cluster of the test bed, with no site written, submits jobs through ``hpcdist.AutoExecutor`` and
waits on them with ``result()``, every Slurm command she runs logged by a wrapper first on her
PATH. Waiting on eight jobs costs the controller what waiting on one does: one ``squeue`` per
poll for all of them, polls 2 s apart at least, no per-job ``scontrol show job`` or ``sacct``;
and a second script within the minute reads the cluster's configuration from her cache, asking
the controller nothing before its ``sbatch``. benchmarks/controller_load.py measures the RPCs."""

from __future__ import annotations

import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.members import Member, member_in, require_members
from tests.support.releases import RELEASES_STATE, release_env, require_release

pytestmark = [pytest.mark.slurm, pytest.mark.other_clusters]  # the 24.11 cluster only

RELEASE = "24.11"
COMMANDS = ("sbatch", "squeue", "sacct", "scontrol", "sinfo", "sacctmgr", "srun")
WAIT = """\
import sys, time
import hpcdist

ex = hpcdist.AutoExecutor("log_%j", timeout_min=3)
jobs = [ex.submit(time.sleep, 6) for _ in range(int(sys.argv[1]))]
with open("commands.log", "a") as f:
    f.write("--- waiting\\n")
t0 = time.monotonic()
assert [j.result() for j in jobs] == [None] * len(jobs)
print("waited", time.monotonic() - t0)
"""


@pytest.fixture
def alice() -> Iterator[Member]:
    require_members()
    require_release(RELEASE)
    folder = Path(f"/home/alice/t-load-{uuid.uuid4().hex[:8]}")
    env = release_env(RELEASE)
    try:
        member = member_in(folder, {"wait.py": WAIT}, **env)
        (folder / "bin").mkdir()
        for name in COMMANDS:  # each command logged, then the release's own run
            wrapper = folder / "bin" / name
            wrapper.write_text(f'#!/bin/sh\necho "{name} $*" >> {folder}/commands.log\n'
                               f'exec {RELEASES_STATE}/{RELEASE}/bin/{name} "$@"\n')
            wrapper.chmod(0o755)
        shutil.chown(folder / "bin", "alice", "alice")
        member.env["PATH"] = f"{folder}/bin:{env['PATH']}"
        yield member
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(alice: Member, jobs: int) -> tuple[Counter[str], Counter[str], float]:
    """The commands alice's script ran before it waited, and while it waited (by command and its
    first word), and how long it waited."""
    log = alice.folder / "commands.log"
    log.unlink(missing_ok=True)
    ran = alice.python("wait.py", str(jobs), timeout=180)
    assert ran.code == 0, ran.err
    before, _, during = log.read_text().partition("--- waiting\n")

    def counted(text: str) -> Counter[str]:  # scontrol and sacctmgr by what they show: "scontrol show config"
        words = [[w for w in line.split() if not w.startswith("-")] for line in text.splitlines() if line.strip()]
        return Counter(" ".join(w[:3 if w[0] in ("scontrol", "sacctmgr") else 1]) for w in words)

    return counted(before), counted(during), float(ran.out.split("waited ")[1].split()[0])


def test_waiting_on_eight_jobs_asks_the_controller_what_one_does(alice: Member) -> None:
    run(alice, 1)  # her first script reads the cluster (discovery), as once an hour
    submit_one, wait_one, _ = run(alice, 1)
    submit_eight, wait_eight, waited = run(alice, 8)
    for submitted, n in ((submit_one, 1), (submit_eight, 8)):
        # within the minute: no configuration, partition or accounting read again; one sbatch per job, and
        # the reservations (what the job may wait behind) once per script
        assert submitted.pop("sbatch") == n and submitted.pop("scontrol show reservation", 0) <= 1, submitted
        assert set(submitted) <= {"srun"}, submitted
    for waiting in (wait_one, wait_eight):
        assert set(waiting) <= {"squeue", "srun"}, waiting  # no sacct, scontrol show job, sinfo while waiting
    assert 1 <= wait_eight["squeue"] <= wait_one["squeue"] + 1, (wait_one, wait_eight)
    assert wait_eight["squeue"] <= waited / 2 + 2, (wait_eight, waited)  # at most one poll per 2 s, for all eight

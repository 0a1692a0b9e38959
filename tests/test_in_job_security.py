"""Another user of the cluster against a job's in-job supervisor (issue 64): the supervisor's port
is open to anyone with a step on the batch node, so every line on it must be the job's.

alice (group mlgroup) runs tests/scripts/elastic_sgd.py through `hpcdist submit --wait` on the
group site with 2 nodes and a spare. carol, outside her group, runs a Slurm step of her own on the
batch node, reads alice's listening ports from /proc/net/tcp, and writes to each what the
supervisor took before its lines were signed (a hello naming rank 1 on a node of the step, then
``failed comm 99999``; ``failed own``; ``done``), opens and closes connections, and holds 40 open,
in three rounds 3 s apart. What alice checks: her job COMPLETED in one run with every step once,
no restart of any kind, and her batch log says what was refused, from where.

srun's own ports (its I/O and message ports, and the PMIx plugin's abort agent) are open to carol
too: on Slurm 22.05 the garbage written there makes srun exit 32 after every rank succeeded. The
supervisor judges by what the ranks said (signed) and says so in the batch log; a job without
spares has no such judge and ends FAILED (Slurm's, not hpcdist's, to fix)."""

from __future__ import annotations

import pwd
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import require_slurm, result_path
from tests.support.members import GROUP_ROOT, finish, require_members, run_as, spawn
from tests.support.train import wait_for
from tests.test_in_job_restart import STEPS, losses, one_run, reference
from tests.test_node_failure import SCRIPT

ATTACK = r"""
import socket, sys, time
uid, rounds = int(sys.argv[1]), int(sys.argv[2])

def ports():
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and int(f[7]) == uid:  # LISTEN, the victim's
            ip, port = f[1].split(":")
            found.add((socket.inet_ntoa(bytes.fromhex(ip)[::-1]), int(port, 16)))
    return found

held, hit = [], set()
for r in range(rounds):
    for ip, port in sorted(ports()):
        where = ("127.0.0.1" if ip == "0.0.0.0" else ip, port)
        for words in (b"x 1 n2\nfailed comm 99999\n", b"12 1 n3\nfailed own 99999\n", b"x 0 n2\ndone\n"):
            try:
                s = socket.create_connection(where, timeout=2)
                s.sendall(words)
                held.append(s)
                hit.add(where)
            except OSError as exc:
                print("refused", where, exc)
        for _ in range(5 if r == 0 else 0):
            try:
                socket.create_connection(where, timeout=2).close()
            except OSError:
                pass
        for _ in range(40 if r == 0 else 0):
            try:
                held.append(socket.create_connection(where, timeout=2))
            except OSError:
                break
    time.sleep(3)
print("attacked", " ".join(f"{a}:{p}" for a, p in sorted(hit)))
"""


@pytest.fixture
def fresh() -> Iterator[Path]:
    """A place in the group root for the job's storage roots."""
    require_slurm()
    require_members()
    base = GROUP_ROOT / "scratch" / f"t-atk-{uuid.uuid4().hex[:8]}"
    base.mkdir(parents=True)
    shutil.chown(base, "alice", "mlgroup")
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slurm  # the suite's cluster group: node-fault tests must not run beside it
def test_another_user_on_the_batch_node_cannot_steer_the_supervisor(fresh: Path, tmp_path: Path) -> None:
    name = f"atk-{uuid.uuid4().hex[:6]}"
    roots = [a for key in ("results", "checkpoints", "scratch", "logs")
             for a in ("--set", f"site.storage.{key}={fresh / key}")]
    job = spawn("alice", "-m", "hpcdist.cli", "submit", "--site", "local-group", "--wait", *roots,
                "--set", f"name={name}", "--set", "resources.nodes=2", "--set", "resources.spare_nodes=1",
                "--set", "timeout_s=5", "--", str(SCRIPT), "--steps", str(STEPS), "--every", "1", "--step-s", "0.5")
    try:
        wait_for(lambda: next(iter(fresh.rglob("step_00000003.h5")), None) or job.poll() is not None, 120,
                 "alice's step 3")
        assert job.poll() is None, finish(job, 10).text
        queued = subprocess.run(["squeue", "-h", "-u", "alice", "-n", name, "-t", "RUNNING", "-o", "%i %B"],
                                capture_output=True, text=True).stdout.split()  # running: not its standby
        jid, batch = queued
        attack = run_as("carol", "srun", "--immediate=60", "-w", batch, "-n", "1", "-t", "2", "/usr/bin/python3",
                        "-c", ATTACK, str(pwd.getpwnam("alice").pw_uid), "3", timeout=120)
        assert attack.code == 0 and "attacked " in attack.out, attack.text
        result = finish(job, 240)
    finally:
        if job.poll() is None:
            job.kill()
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in result.out, result.out
    one_run(jid)
    log = "\n".join(p.read_text(errors="replace") for p in sorted(fresh.rglob("*_0_log.err")))
    attacked = re.search(r"attacked (.*)", attack.out)
    assert attacked and attacked.group(1), attack.out
    assert re.search(r"warning: in-job: a connection to the supervisor's port from 10\.251\.0\.1\d said who it is "
                     r"without the job's key .*: ignored, the job goes on", log), log[-3000:]
    assert "in-place restart" not in log and "starts again" not in log and "started again" not in log, log[-3000:]
    assert len(re.findall(r"hpcdist: in-job step \d+ on ", log)) == 1, log[-3000:]  # the first step only
    got = losses(result_path(result.out))  # every step once
    assert got == reference(tmp_path, 2)  # bit for bit an unattacked run's


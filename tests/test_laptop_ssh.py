"""Submitting from a laptop (issue 66, item 1): alice's hpcdist with no Slurm on her machine runs
Slurm's commands on the login node through her own ssh (``hpcdist --on login``), over the test
bed's sshd (cluster/sshd.sh) and one shared connection; the job's files go up by rsync and its
logs and result come back. The laptop is a mount namespace without Slurm's commands, configs or
munge, with its own home and disk (tests.support.laptop); the cluster is the suite's real one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.support import laptop
from tests.support.cli import job_id, require_slurm

pytestmark = pytest.mark.slurm

ON = ("--on", laptop.HOST)
SITE = ("--site", "local-group")  # the group's site: absolute storage roots alice may use


@pytest.fixture(scope="module")
def tag() -> Iterator[str]:
    """The laptop set up (its ssh config, key, known_hosts, disk) and a tag for this run's job
    names; their folders on the cluster and the laptop go afterwards, and so does the connection."""
    require_slurm()
    laptop.require_login()
    laptop.setup()
    tag = uuid.uuid4().hex[:6]
    yield tag
    laptop.end_connection()
    for root in (laptop.GROUP_ROOT, laptop.disk_root()):
        for folder in root.glob(f"*/{laptop.USER}/*-{tag}"):
            shutil.rmtree(folder, ignore_errors=True)


def _script(name: str, seconds: float) -> str:
    """A script in the laptop's work folder (the code snapshot goes up with the job)."""
    path = laptop.home() / "work" / f"{name}.py"
    path.write_text(f"import time\ntime.sleep({seconds})\nprint('slept {seconds}')\n")
    shutil.chown(path, laptop.USER, laptop.USER)
    return f"work/{name}.py"


def test_smoke_on_two_nodes_from_the_laptop_then_jobs_and_logs(tag: str) -> None:
    probe = laptop.on_laptop("sh", "-c", "command -v sbatch srun squeue; ls /etc/slurm")
    assert probe.out.strip() == "", probe.text  # no Slurm here: every command runs on the login node
    run = laptop.hpcdist(*ON, "submit", str(laptop.REPO / "jobs" / "smoke.yaml"), *SITE,
                         "--set", "resources.nodes=2", "--set", f"name=smoke-{tag}", "--wait")
    assert run.code == 0, run.text
    assert "finished: COMPLETED; 4/4 ranks succeeded" in run.out, run.text
    hosts = {json.loads(line.split(" ok ", 1)[1])["host"] for line in run.out.splitlines() if " ok {" in line}
    assert len(hosts) == 2, run.out  # two nodes of the cluster, reached from a machine without Slurm
    jid = job_id(run.out)
    result = f"results/{laptop.USER}/smoke-{tag}/{jid}.h5"
    assert (laptop.GROUP_ROOT / result).is_file() and (laptop.disk_root() / result).is_file()  # there, and back here

    jobs = laptop.hpcdist(*ON, "jobs", "--json")
    row = next(r for r in json.loads(jobs.out) if r["job_id"] == jid)
    assert (row["state"], row["nodes"]) == ("COMPLETED", "n[1-2]"), jobs.text
    logs = laptop.hpcdist(*ON, "logs", jid, "--rank", "3")
    assert logs.code == 0 and "rank 3/4" in logs.out, logs.text


def test_cancel_from_the_laptop(tag: str) -> None:
    run = laptop.hpcdist(*ON, "submit", *SITE, "--set", f"name=nap-{tag}", "--", _script(f"nap{tag}", 300))
    assert run.code == 0, run.text
    jid = job_id(run.out)
    cancelled = laptop.hpcdist(*ON, "cancel", jid)
    assert cancelled.code == 0, cancelled.text
    state = subprocess.run(["squeue", "-h", "--states=all", "-j", jid, "-o", "%T"], capture_output=True, text=True,
                           check=False).stdout.strip()
    assert state in ("CANCELLED", "COMPLETING"), state  # Slurm's own word on the cluster side


def test_a_dropped_connection_during_wait_leaves_the_job_running_and_wait_picks_it_up(tag: str) -> None:
    proc = subprocess.Popen(laptop.laptop_argv(*laptop.hpcdist_argv(
        *ON, "submit", *SITE, "--set", f"name=drop-{tag}", "--wait", "--", _script(f"drop{tag}", 6)),
        env={"PYTHONUNBUFFERED": "1"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("submitted job"), first + (proc.stderr.read() if proc.stderr else "")
        jid = first.split()[2]
        time.sleep(2.0)
        said = laptop.close_connection()  # the shared connection dies as a dropped network kills it
        assert "Master running" in said, said
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
    # the waiting goes on over a new connection, and the job was never touched
    assert proc.returncode == 0 and "finished: COMPLETED; 1/1 ranks succeeded" in out, first + out + err
    again = laptop.hpcdist(*ON, "wait", jid)
    assert again.code == 0 and f"job {jid} finished: COMPLETED" in again.out, again.text
    assert "slept 6" in laptop.hpcdist(*ON, "logs", jid).out


def test_an_unknown_host_key_is_one_line_saying_what_to_do(tag: str) -> None:
    run = laptop.hpcdist("--on", "login-unverified", "jobs")
    assert run.code == 2 and run.err.count("\n") == 1, run.text
    assert "host key is not known" in run.err and "ssh login-unverified" in run.err, run.text

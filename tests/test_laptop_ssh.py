"""Submitting from a laptop (issue 66, item 1): alice's hpcdist with no Slurm on her machine runs
Slurm's commands on the login node through her own ssh (``hpcdist --on login``), over the test
bed's sshd (cluster/sshd.sh) and one shared connection; the job's files go up by rsync and its
logs and result come back. The laptop is a mount namespace without Slurm's commands, configs or
munge, with its own home and disk (tests.support.laptop); the cluster is the suite's real one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import laptop
from tests.support.cli import job_id, require_slurm
from tests.support.train import TINY, preempt_and_release, prepare_tokens, wait_for

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
        for folder in root.glob(f"*/{laptop.USER}/*-{tag}*"):  # an array's items are NAME-TAG-I
            shutil.rmtree(folder, ignore_errors=True)
    for path in (laptop.home() / "work").glob(f"*{tag}*"):  # its scripts and the site `site init` wrote
        path.unlink()


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
    # the code snapshot went up before sbatch, with its progress line (one line where stderr is no terminal)
    sent = r"^hpcdist: the code snapshot sent to login: \d+ files, [\d.]+ [kM]B in [\d.]+ s$"
    assert re.search(sent, run.err, re.M), run.text
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


def test_an_unknown_host_key_or_a_refused_connection_is_one_line_saying_what_to_do(tag: str) -> None:
    run = laptop.hpcdist("--on", "login-unverified", "jobs")
    assert run.code == 2 and run.err.count("\n") == 1, run.text
    assert "host key is not known" in run.err and "connect once with `ssh login-unverified`" in run.err, run.text
    refused = laptop.hpcdist("submit", str(laptop.REPO / "jobs" / "smoke.yaml"), *SITE,
                             env={"HPCDIST_LOGIN": "login-closed"})  # the variable, as --on
    assert refused.code == 2 and refused.err.count("\n") == 1, refused.text
    assert refused.err.startswith("hpcdist: error: ssh login-closed: the connection was refused"), refused.text
    assert "is the host or Port right in ~/.ssh/config? `ssh login-closed true` must work first" in refused.err


SQUARES = """import sys
import hpcdist

def square(x):
    return x * x

def where(ctx: hpcdist.Context, x):  # a rank's Context: hpcdist's bootstrap and group, its call pickled
    return [ctx.rank, ctx.world_size, x]

folder, tag = sys.argv[1:]
plain = hpcdist.Executor(folder + "/plain/%j", login="login", site="local-group", time_min=5, name="sq-" + tag)
group = hpcdist.Executor(folder + "/group/%j", login="login", site="local-group", tasks_per_node=2, time_min=5,
                         name="where-" + tag)
squares, ranks = plain.map_array(square, [1, 2, 3]), group.map_array(where, [10, 20])
print("ids", *(job.job_id for job in squares + ranks), flush=True)
print("squares", [job.result() for job in squares])
print("ranks", [job.results() for job in ranks])
"""


def test_executor_map_array_from_the_laptop_then_job_by_id_over_hpcdist_login(tag: str) -> None:
    script = laptop.home() / "work" / f"squares{tag}.py"
    script.write_text(SQUARES)
    shutil.chown(script, laptop.USER, laptop.USER)
    folder = laptop.GROUP_ROOT / "logs" / laptop.USER / f"exec-{tag}"
    python = str(laptop.USERS_VENV / "bin" / "python")
    run = laptop.on_laptop(python, f"work/{script.name}", str(folder), tag)
    assert run.code == 0, run.text
    assert "squares [1, 4, 9]" in run.out and "ranks [[[0, 2, 10], [1, 2, 10]], [[0, 2, 20], [1, 2, 20]]]" in run.out
    ids = run.out.split("ids ", 1)[1].split("\n", 1)[0].split()
    assert [i.split("_")[1] for i in ids] == ["0", "1", "2", "0", "1"], ids  # two job arrays on the cluster
    assert "hpcdist: the calls sent to login: " in run.err, run.text  # the pickled calls went up before sbatch
    # every rank's result back on the laptop's own disk, and a job found again by id from another process
    assert len(list(laptop.disk_root().glob(f"logs/{laptop.USER}/exec-{tag}/group/*/*_result.pkl"))) == 4
    again = laptop.on_laptop(python, "-c", f"import hpcdist; print(hpcdist.job({ids[4]!r}).results())",
                             env={"HPCDIST_LOGIN": laptop.HOST})
    assert again.code == 0 and again.out.strip() == "[[0, 2, 20], [1, 2, 20]]", again.text


@pytest.fixture()
def cluster_tokens(tag: str) -> Path:
    """A token file in alice's folder of the group's scratch on the cluster, where the nodes read it
    (the laptop has none: submit warns, and the job reads the cluster's); the tag's clean-up removes it."""
    folder = laptop.GROUP_ROOT / "scratch" / laptop.USER / f"tokens-{tag}"
    folder.mkdir(parents=True)
    tokens = prepare_tokens(folder, "tokens", words=6000)
    for path in (folder, *folder.iterdir()):
        shutil.chown(path, laptop.USER, laptop.USER)
    return tokens


def test_train_gpt_from_the_laptop_preempted_requeued_and_resumed(tag: str, cluster_tokens: Path) -> None:
    name = f"train-{tag}"
    proc = subprocess.Popen(laptop.laptop_argv(*laptop.hpcdist_argv(
        *ON, "submit", str(laptop.REPO / "jobs" / "train_gpt.yaml"), *SITE, "--set", f"name={name}",
        "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1", "--set", f"params.data={cluster_tokens}",
        *TINY, "--wait"), env={"PYTHONUNBUFFERED": "1"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("submitted job"), first + (proc.stderr.read() if proc.stderr else "")
        jid = first.split()[2]
        log = laptop.GROUP_ROOT / "logs" / laptop.USER / name / jid / "train_rank0.log"  # on the cluster
        wait_for(lambda: log.is_file() and "step 20/400" in log.read_text(), 120, "step 20 in rank 0's log")
        preempt_and_release(jid, "requeue")  # as Slurm's PreemptMode=REQUEUE: SIGTERM, then requeued
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
    assert proc.returncode == 0 and f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in out, first + out + err
    assert '"requeues": 1' in out, out
    history = subprocess.run(["sacct", "-j", jid, "-X", "-n", "-P", "--duplicates", "-o", "State"],
                             capture_output=True, text=True, check=False).stdout.split()
    assert history == ["REQUEUED", "COMPLETED"], history
    shown = laptop.hpcdist(*ON, "logs", jid).out  # rank 0's log of both runs, brought back over ssh
    stopped = re.search(r"TERM signal received: checkpointing at step (\d+)", shown)
    assert stopped, shown[-3000:]
    step = int(stopped[1])
    checkpoint = laptop.GROUP_ROOT / "checkpoints" / laptop.USER / name / f"step_{step:08d}.h5"
    assert f"resumed from {checkpoint}: step {step}" in shown, shown[-3000:]
    assert (laptop.disk_root() / "results" / laptop.USER / name / f"{jid}.h5").is_file()  # the result, back here


def test_render_sites_show_site_init_and_site_check_over_ssh(tag: str) -> None:
    rendered = laptop.hpcdist(*ON, "render", str(laptop.REPO / "jobs" / "smoke.yaml"), *SITE)
    assert rendered.code == 0 and "#SBATCH --nodes=1" in rendered.out, rendered.text  # no sbatch here: nothing run
    shown = laptop.hpcdist(*ON, "sites", "--show", "slurm")  # the cluster behind the login node, read over ssh
    assert shown.code == 0 and "the Slurm cluster 'hpcdist'" in shown.out and "as user alice" in shown.out, shown.text
    assert "ch-run is on PATH on the login node (login) (/usr/bin/ch-run)" in shown.out, shown.out
    made = laptop.hpcdist(*ON, "site", "init", f"cluster-{tag}", "-o", f"work/cluster-{tag}.yaml")
    assert made.code == 0 and made.out.startswith(f"wrote work/cluster-{tag}.yaml: site"), made.text
    assert (laptop.home() / "work" / f"cluster-{tag}.yaml").is_file()  # written on the laptop
    checked = laptop.hpcdist(*ON, "site", "check", "local-group")
    assert checked.code == 0, checked.text
    # the storage claim: written on two nodes, seen on the login node (not on the laptop, which has its own disk)
    assert re.search(r"^storage +its roots are shared +two nodes and the login node see them +ok$", checked.out, re.M)
    assert "login node has /usr/bin/ch-run" in checked.out, checked.out

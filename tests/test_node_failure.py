"""A dead node on the 4-node cluster: the job runs again without it and ends COMPLETED.

A node is killed as hardware dies (cluster/nodefault.sh: link cut, slurmd and every process in it
killed) a few steps after a checkpoint. Slurm declares it DOWN after SlurmdTimeout and requeues
the job under the same id; the waiter (`submit --wait`) excludes the node from the pending job and
lowers its node count (train_gpt's default, resources.min_nodes), and the job resumes from its last committed
checkpoint on the nodes that remain. What a user checks: every step done, the dead node named as
excluded in the summary and the result file, the ranks of the last run reported, and the same
final loss as an uninterrupted continuation at the smaller world size. Slurm holds a requeued job
for about two minutes (BeginTime); the tests start it once the node is excluded, as
tests/support/train.py's preemption tests do. Without a waiter, the requeued run's own start
records and bounds the failure (and a late `hpcdist wait` acts as an early one would); those
two tests kill one node for two checks each. Only n3 and n4 are ever killed here (other tests
may run on n1 and n2), and they are revived after each test, even one that fails.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest
import torch

from hpcdist.store.records import health
from hpcdist.store.results import read_attrs, read_table
from tests.netfault import killed, revive
from tests.support import train as fx
from tests.support.cli import REPO, Run, job_id, result_path, run_cli, storage_sets
from tests.support.train import (
    Background,
    ckpt_dir,
    queue_state,
    rank_log,
    start_now,
    train,
    train_args,
    wait_for,
)

train_root, tokens = fx.train_root, fx.tokens
SCRIPT = REPO / "tests" / "scripts" / "elastic_sgd.py"
REQUEUED_WITHIN_S = 120  # SlurmdTimeout (20 s here) and a ping period, then the requeue; with room


@pytest.fixture
def four_nodes(separate_hosts: Path) -> Iterator[Path]:
    """The cluster's n2, n3 and n4 up before the test (a test that died may have left one down) and
    revived after it; the test's storage root."""
    for node in ("n2", "n3", "n4"):
        revive(node)
    yield separate_hosts
    for node in ("n2", "n3", "n4"):
        revive(node)


def job_of(job: Background) -> str:
    return wait_for(lambda: (m := re.search(r"submitted job (\d+)", job.printed())) and m.group(1), 60,
                    "the job id")


def committed_step(job: Background, path: Path) -> None:
    """Wait until the checkpoint `path` is committed; the job's output if it ends before."""
    def there() -> bool:
        if job.proc.poll() is not None:
            raise AssertionError(f"the job ended before {path.name}: {job.finish(10).text}")
        return path.exists()

    wait_for(there, 120, f"the checkpoint {path.name}")


def excluded(jid: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True).stdout
    match = re.search(r"ExcNodeList=(\S+)", out)
    return "" if match is None or match.group(1) == "(null)" else match.group(1)


def kill_and_rerun(node: str, jid: str, ckpts: Path, job: Background, timeout: float = 180) -> tuple[Run, str, float]:
    """Kill `node` (revived on the way out); once the waiter has excluded it from the requeued
    job, start the job now. Returns how `submit --wait` ended, the checkpoint committed when the
    job was requeued (what it must resume from), and the seconds from the kill to the requeue."""
    with killed(node):
        t_kill = time.monotonic()
        wait_for(lambda: queue_state(jid).startswith("PENDING") and node in excluded(jid), REQUEUED_WITHIN_S,
                 f"the job requeued with {node} excluded")
        requeued_s = time.monotonic() - t_kill
        committed = (ckpts / "latest").read_text().split()[-1]
        time.sleep(2)  # not within a second of the requeue: the old run's credential (tests/support/train.py)
        start_now(jid)
        return job.finish(timeout), committed, requeued_s


def history(jid: str) -> list[str]:
    return subprocess.run(["sacct", "-j", jid, "-X", "-n", "-P", "--duplicates", "-o", "State"],
                          capture_output=True, text=True).stdout.split()


def assert_ran_again_without(node: str, jid: str, result: Run, hosts: list[str],
                              file: Path | None = None) -> dict[str, object]:
    """COMPLETED on `hosts` after one NODE_FAIL, with `node` named as excluded; the result's attrs
    (the result `file` the submit printed, unless given)."""
    assert result.code == 0, result.text
    ranks = len(hosts)
    assert f"job {jid} finished: COMPLETED; {ranks}/{ranks} ranks succeeded" in result.out, result.out
    assert re.search(rf"ran again without node {node} \(died in run 1, ended \S+; excluded at ", result.out)
    assert history(jid) == ["NODE_FAIL", "COMPLETED"]
    attrs = read_attrs(file or result_path(result.out))
    assert attrs["excluded_nodes"] == node and attrs["hosts"] == hosts and attrs["world_size"] == ranks
    listed = json.loads(run_cli("jobs", "--json").out)
    assert next(j for j in listed if j["job_id"] == jid)["excluded"].startswith(f"{node} (died in run 1")
    return attrs


def test_train_gpt_goes_on_without_a_dead_node(four_nodes: Path, train_root: Path, tokens: Path) -> None:
    """The whole partition (4 nodes x 1 task), no spare and no min_nodes: train_gpt shrinks by its
    kind's default, and the shrunk run's step takes its task count from the run's 3 nodes (before:
    `srun: error: Unable to create step for job N: More processors requested than permitted`, the
    submission's SLURM_NTASKS=4 inherited; FAILED, `0/3 ranks succeeded`)."""
    root, steps = four_nodes, 120
    common = ["--set", f"params.steps={steps}", "--set", "params.checkpoint.every=10",
              "--set", "params.checkpoint.keep_last=100"]
    job = Background(train_args(root, tokens, "--set", "resources.nodes=4", "--set", "resources.tasks_per_node=1",
                                "--set", "timeout_s=10", *common, site="local-slurm"))
    try:
        jid = job_of(job)
        committed_step(job, ckpt_dir(root) / "step_00000020.h5")
        result, committed, _ = kill_and_rerun("n3", jid, ckpt_dir(root), job)
    finally:
        job.kill()
    assert_ran_again_without("n3", jid, result, ["n1", "n2", "n4"])
    step = int(committed.removeprefix("step_").removesuffix(".h5"))
    assert 20 <= step < steps, committed
    assert f"resumed from {ckpt_dir(root) / committed}: step {step}" in rank_log(root), rank_log(root)[-2000:]
    with h5py.File(result_path(result.out)) as f:
        got = read_table(f["train/steps"])
    assert got["step"].tolist()[-1] == steps
    # the reference: the same checkpoint continued uninterrupted at 3 ranks, on this machine
    ref_root = train_root / "node-failure-reference"
    ref_ckpts = ckpt_dir(ref_root)
    ref_ckpts.mkdir(parents=True)
    shutil.copy(ckpt_dir(root) / committed, ref_ckpts / committed)
    (ref_ckpts / "latest").write_text((ckpt_dir(root) / "latest").read_text().rsplit("\n", 2)[0] + f"\n{committed}\n")
    ref = train(ref_root, tokens, "--set", "resources.tasks_per_node=3", *common)
    assert ref.code == 0, ref.text
    with h5py.File(result_path(ref.out)) as f:
        want = read_table(f["train/steps"])
    assert f"resumed from {ref_ckpts / committed}: step {step}" in rank_log(ref_root)
    assert want["step"].tolist()[-1] == steps
    assert math.isclose(got["loss"][-1], want["loss"][-1], rel_tol=1e-5), (got["loss"][-1], want["loss"][-1])


def uninterrupted_losses(steps: int) -> list[float]:
    """elastic_sgd.py's losses, computed here in one process on the whole global batch: what the
    script computes at any world size, up to float rounding."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from elastic_sgd import BATCH, FEATURES, batch  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(SCRIPT.parent))
    w = torch.zeros(FEATURES, 1, dtype=torch.float64)
    losses = []
    for step in range(1, steps + 1):
        x, y = batch(step)
        err = x @ w - y
        w -= 0.1 * (2 * x.T @ err) / BATCH
        losses.append(float((err**2).sum() / BATCH))
    return losses


def run_script(root: Path, node: str, *sets: str, steps: int = 40) -> tuple[str, Run, str]:
    """elastic_sgd.py as a python job with `sets`; `node` killed after its 10th step's checkpoint."""
    job = Background(["submit", "--site", "local-slurm", "--wait", *storage_sets(root), "--set", "timeout_s=10",
                      "--set", "on_node_failure=requeue", *sets,
                      "--", str(SCRIPT), "--steps", str(steps), "--every", "2", "--step-s", "0.25"])
    ckpts = root / "checkpoints" / "elastic_sgd"
    try:
        jid = job_of(job)
        committed_step(job, ckpts / "step_00000010.h5")
        result, committed, _ = kill_and_rerun(node, jid, ckpts, job)
    finally:
        job.kill()
    return jid, result, committed


def assert_resumed_like_uninterrupted(result: Run, committed: str, steps: int, ranks: int,
                                      file: Path | None = None) -> None:
    file = file or result_path(result.out)
    attrs = read_attrs(file)
    step = int(committed.removeprefix("step_").removesuffix(".h5"))
    assert 10 <= step < steps and attrs["resumed_from"] == step and attrs["ran_with"] == ranks, (committed, attrs)
    with h5py.File(file) as f:
        losses = read_table(f["loss"])["loss"].tolist()
    want = uninterrupted_losses(steps)
    assert len(losses) == steps and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(losses, want, strict=True))


def test_a_user_script_goes_on_when_its_head_node_dies(four_nodes: Path) -> None:
    """A user's script on n2, n3 and n4; n2 runs the batch script, rank 0 and its store: only Slurm
    is left to act. The waiter takes n2 out of the requeued job's nodes (and its nodelist), and the
    script resumes at 2 ranks, every loss as the world-size-free reference's."""
    jid, result, committed = run_script(four_nodes, "n2", "--set", "resources.nodes=3",
                                        "--set", "resources.min_nodes=2", "--set", "sbatch.nodelist=n2,n3,n4")
    assert_ran_again_without("n2", jid, result, ["n3", "n4"])
    assert_resumed_like_uninterrupted(result, committed, 40, 2)


def test_the_spec_keys_are_checked_and_rendered() -> None:
    """min_nodes above nodes, or an unknown on_node_failure, is one line naming the value; a job
    that may shrink asks Slurm for its full size, and every job takes its task count from the run's
    nodes (any may shrink: its kind's default, or hpcdist checkpoints the waiter finds only then)."""
    base = ("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "resources.nodes=4")
    too_few = run_cli(*base, "--set", "resources.min_nodes=5")
    assert too_few.code == 2 and "min_nodes 5 is more than nodes 4; set min_nodes to at most 4" in too_few.err
    assert len(too_few.err.strip().splitlines()) == 1, too_few.err
    unknown = run_cli(*base, "--set", "on_node_failure=retry")
    assert unknown.code == 2 and "on_node_failure" in unknown.err and "'retry'" in unknown.err, unknown.err
    script = run_cli(*base, "--set", "resources.min_nodes=2", "--set", "resources.tasks_per_node=2")
    assert script.code == 0, script.text
    assert "#SBATCH --nodes=4\n" in script.out and "#SBATCH --requeue\n" in script.out
    assert "export SLURM_NTASKS=$((SLURM_JOB_NUM_NODES * 2))" in script.out
    assert "export SLURM_NTASKS=$((SLURM_JOB_NUM_NODES * 2))" in run_cli(*base).out  # no min_nodes: the same


def submitted(root: Path, *sets: str, steps: int) -> str:
    """elastic_sgd.py submitted WITHOUT waiting (nothing of hpcdist runs on the login side); its id."""
    out = run_cli("submit", "--site", "local-slurm", *storage_sets(root), "--set", "timeout_s=10", *sets,
                  "--", str(SCRIPT), "--steps", str(steps), "--every", "2", "--step-s", "0.25")
    assert out.code == 0, out.text
    return job_id(out.out)


def requeued(jid: str) -> bool:
    return queue_state(jid).startswith("PENDING") and "Restarts=1" in subprocess.run(
        ["scontrol", "-o", "show", "job", jid], capture_output=True, text=True).stdout


def test_a_waiter_started_after_the_death_cancels_a_job_that_asks_to_fail(four_nodes: Path) -> None:
    """The python kind's default, on_node_failure: fail, and nobody waiting when the node dies:
    `hpcdist wait` started once the job is back in the queue (Slurm's restart count is the
    evidence) cancels Slurm's requeue and says which node died and why the job did not run again."""
    jid = submitted(four_nodes, "--set", "resources.nodes=2", "--set", "sbatch.nodelist=n3,n4", steps=400)
    wait_for(lambda: (four_nodes / "checkpoints" / "elastic_sgd" / "step_00000004.h5").exists(), 120,
             "the checkpoint step_00000004.h5")
    with killed("n4"):
        wait_for(lambda: requeued(jid), REQUEUED_WITHIN_S, "the job requeued")
        result = run_cli("wait", jid, timeout=60)
    assert result.code == 1, result.text
    assert f"job {jid} finished: NODE_FAIL" in result.out, result.out
    assert re.search(r"cause: node n4 died \(run 1 ended NODE_FAIL at \S+\); on_node_failure is fail, so Slurm's "
                     r"requeue was cancelled", result.out), result.out
    assert history(jid)[0] == "NODE_FAIL" and queue_state(jid) in ("", "CANCELLED None")  # not run again
    assert [m.node for m in health.marks(four_nodes / "scratch" / "node-health")] == ["n4"]


def test_without_a_waiter_the_requeued_run_records_bounds_and_ends(four_nodes: Path) -> None:
    """Two jobs submitted without waiting share the node that dies (1 node each, Slurm packs them):
    one asks to requeue, one to fail. Slurm requeues both onto the spare node; each run's own start
    records the dead node in the site's health record, and then the first goes on (the job's record,
    resumed from its checkpoint, COMPLETED) while the second ends before its ranks start, its one
    line the cause a late `hpcdist wait` prints."""
    roots = {policy: four_nodes / policy for policy in ("requeue", "fail")}
    one_node = ("--set", "resources.nodes=1", "--set", "sbatch.exclude=n1,n2")
    goes_on = submitted(roots["requeue"], *one_node, "--set", "on_node_failure=requeue", steps=40)
    ends = submitted(roots["fail"], *one_node, steps=400)
    ckpts = roots["requeue"] / "checkpoints" / "elastic_sgd"
    wait_for(lambda: (ckpts / "step_00000010.h5").exists(), 120, "the checkpoint step_00000010.h5")
    placed = {line for line in subprocess.run(["squeue", "-h", "-j", f"{goes_on},{ends}", "-o", "%T %N"],
                                              capture_output=True, text=True).stdout.splitlines()}
    assert placed in ({"RUNNING n3"}, {"RUNNING n4"}), f"the two jobs do not run together on one node: {placed}"
    dead = placed.pop().split()[1]
    with killed(dead):
        wait_for(lambda: requeued(goes_on) and requeued(ends), REQUEUED_WITHIN_S, "both jobs requeued")
        committed = (ckpts / "latest").read_text().split()[-1]
        time.sleep(2)  # not within a second of the requeue (tests/support/train.py)
        for jid in (goes_on, ends):
            start_now(jid)
        wait_for(lambda: not queue_state(goes_on) and not queue_state(ends), 90, "both jobs to end")  # dead till then
    assert history(goes_on) == ["NODE_FAIL", "COMPLETED"] and history(ends) == ["NODE_FAIL", "FAILED"]
    for root in roots.values():
        assert [(m.node, m.source) for m in health.marks(root / "scratch" / "node-health")] == [(dead, "node_failure")]
    result = run_cli("wait", goes_on, timeout=60)  # a waiter after the end: it only reads
    file = roots["requeue"] / "results" / "elastic_sgd" / f"{goes_on}.h5"
    assert_ran_again_without(dead, goes_on, result, ["n3" if dead == "n4" else "n4"], file)
    assert_resumed_like_uninterrupted(result, committed, 40, 1, file)
    stopped = run_cli("wait", ends, timeout=60)
    assert stopped.code == 1 and f"job {ends} finished: NODE_FAIL" in stopped.out, stopped.text  # as a waiter's
    assert re.search(rf"cause: node {dead} died \(run 1 ended NODE_FAIL at \S+\); on_node_failure is fail, so this "
                     r"run ends before its ranks start \(set on_node_failure: requeue", stopped.out), stopped.out
    log = (roots["fail"] / "logs" / "elastic_sgd" / ends / f"{ends}_0_log.err").read_text()
    assert log.count("hpcdist: not run again: ") == 1 and "group ready" not in log.split("not run again")[1]

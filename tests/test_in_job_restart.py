"""Hot spares (``resources.spare_nodes``): a node dies and the job goes on in the same allocation.

A user's script (tests/scripts/elastic_sgd.py, a checkpoint every step) is submitted through
`hpcdist submit --wait` with a spare; a node of its step is killed as hardware dies
(cluster/nodefault.sh: link cut, slurmd and every process in it killed) after step 10's
checkpoint. The job's supervisor (hpcdist.runtime.in_job) notices it, kills the step, and starts
the ranks again on the live nodes and the spare. What a user checks: the job COMPLETED under its
first run (no requeue, no NODE_FAIL in accounting), on the nodes that lived, every step's loss
once and equal bit for bit to an uninterrupted run's at the same world size, the dead node
named in the summary and marked in the site's node health record. The nodes killed are revived
after each test, even one that fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import h5py
import pytest

import hpcdist
from hpcdist.config.contract import IMITATE_ABORT_VAR
from hpcdist.store.records import health
from hpcdist.store.results import read_attrs, read_table
from tests.netfault import controller_refused, killed, revive
from tests.support.cli import Run, rank_pids, result_path, run_cli, storage_sets
from tests.support.train import Background, queue_state, wait_for
from tests.test_node_failure import SCRIPT, committed_step, history, job_of

STEPS = 40


@pytest.fixture
def four_nodes(separate_hosts: Path) -> Iterator[Path]:
    """Every node up before the test and after it; the test's storage root."""
    for node in ("n2", "n3", "n4"):
        revive(node)
    yield separate_hosts
    for node in ("n2", "n3", "n4"):
        revive(node)


def batch_log(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((root / "logs").rglob("*_0_log.err")))


def losses(file: Path) -> list[float]:
    with h5py.File(file) as f:
        table = read_table(f["loss"])
    assert table["step"].tolist() == list(range(1, STEPS + 1)), table["step"].tolist()  # each step once
    return table["loss"].tolist()


_REFERENCES: dict[int, list[float]] = {}


def reference(root: Path, ranks: int) -> list[float]:
    """The same script uninterrupted at `ranks` ranks (the local site: the same gloo sums); run
    once per world size for the module."""
    if ranks not in _REFERENCES:
        ref = run_cli("submit", "--site", "local", "--wait", *storage_sets(root / "reference"),
                      "--set", f"resources.tasks_per_node={ranks}", "--", str(SCRIPT), "--steps", str(STEPS))
        assert ref.code == 0, ref.text
        _REFERENCES[ranks] = losses(result_path(ref.out))
    return _REFERENCES[ranks]


def submit_spared(root: Path, *sets: str, timeout_s: int = 5,
                  script: tuple[str, ...] = ("--step-s", "0.25"), env: dict[str, str] | None = None) -> Background:
    """elastic_sgd.py (a checkpoint every step) through `hpcdist submit --wait` on the cluster, `sets` added."""
    return Background(["submit", "--site", "local-slurm", "--wait", *storage_sets(root),
                       "--set", f"timeout_s={timeout_s}", *sets,
                       "--", str(SCRIPT), "--steps", str(STEPS), "--every", "1", *script], env=env)


def spared(root: Path, *sets: str, kills: tuple[str, ...], between: str = "") -> tuple[str, Run]:
    """elastic_sgd.py with spares; `kills` killed after its 10th checkpoint, each after the
    supervisor's line `between` names the one before (at once when ""). A rank whose node died
    before it started is found by the others' rendezvous timeout: 5 s."""
    job = submit_spared(root, *sets)
    try:
        with ExitStack() as dead:
            jid = job_of(job)
            committed_step(job, root / "checkpoints" / "elastic_sgd" / "step_00000010.h5")
            for n, node in enumerate(kills):
                if n and between:
                    line = between.format(node=kills[n - 1])
                    wait_for(lambda line=line: line in batch_log(root), 60, f"the supervisor's line {line!r}")
                dead.enter_context(killed(node))  # revived once the job ended
            return jid, job.finish(180)
    finally:
        job.kill()


def one_run(jid: str) -> None:
    """Accounting shows one run: no NODE_FAIL, no REQUEUED; a RESIZING record where Slurm took
    the dead node out of the allocation before the job ended (--no-kill), then COMPLETED."""
    states = history(jid)
    assert states[-1] == "COMPLETED" and set(states) <= {"RESIZING", "COMPLETED"}, states


def completed_once(jid: str, result: Run, ranks: int, root: Path) -> str:
    """The job COMPLETED, every rank succeeded, in one run; its batch log."""
    log = batch_log(root)
    assert result.code == 0, result.text + log[-3000:]
    assert f"job {jid} finished: COMPLETED; {ranks}/{ranks} ranks succeeded" in result.out, result.out
    one_run(jid)
    return log


def assert_went_on(jid: str, result: Run, hosts: list[str], dead: list[str], root: Path) -> dict[str, object]:
    """COMPLETED in its first run on `hosts`, the `dead` nodes named, marked and in the log."""
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; {len(hosts)}/{len(hosts)} ranks succeeded" in result.out, result.out
    one_run(jid)
    attrs = read_attrs(result_path(result.out))
    assert attrs["hosts"] == hosts and attrs["world_size"] == len(hosts), attrs
    assert attrs["excluded_nodes"] == ",".join(dead), attrs
    for node in dead:
        assert re.search(rf"ran again without node {node} \(died in run 1, ", result.out), result.out
        assert re.search(rf"hpcdist: in-job: (node|spare) {node} (died|is dead too)", batch_log(root))
    marked = {(m.node, m.source) for m in health.marks(root / "scratch" / "node-health")}
    assert marked == {(node, "node_failure") for node in dead}, marked
    return attrs


def test_a_killed_rank_then_a_dead_node_go_on_in_the_same_allocation(four_nodes: Path) -> None:
    """3 nodes + 1 spare (all four): the step runs on n2-n4, n1 (the batch node) waits. After step
    10 rank 2's process (on n4) is killed, its node alive: srun saw a task end by a signal, so the
    step starts again on the same nodes. After step 20 n3 dies: the spare n1 takes its place. The
    script logs its loss to MLflow (a SQLite file on the shared storage): one run throughout.
    srun runs as on a site whose WaitTime is 1 s (SLURM_WAIT=1 in the submit's environment): the
    supervisor's --wait=0 keeps ranks 0 and 1 in their processes after rank 2's end."""
    from mlflow.tracking import MlflowClient

    root = four_nodes
    uri = f"sqlite:///{root / 'mlflow.db'}"
    job = submit_spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1",
                        "--set", "on_rank_failure=in_place",
                        "--set", f"tracking.mlflow={{uri: '{uri}', experiment: spare}}", timeout_s=10,
                        env={"SLURM_WAIT": "1"})  # srun as on a site with WaitTime=1: it would end the survivors
    ckpts = root / "checkpoints" / "elastic_sgd"
    try:
        jid = job_of(job)
        committed_step(job, ckpts / "step_00000010.h5")
        before = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(rank_pids(str(root / "logs"))), 30,
                          "the 3 ranks' processes")
        os.kill(before[2], signal.SIGKILL)
        committed_step(job, ckpts / "step_00000020.h5")
        after = rank_pids(str(root / "logs"))  # in place: ranks 0 and 1 in the same processes, rank 2 in a new one
        assert after[0] == before[0] and after[1] == before[1] and after.get(2, before[2]) != before[2], (before, after)
        with killed("n3"):
            result = job.finish(180)
    finally:
        job.kill()
    attrs = assert_went_on(jid, result, ["n1", "n2", "n4"], ["n3"], root)
    assert 20 <= attrs["resumed_from"] < STEPS and attrs["ran_with"] == 3, attrs
    assert "rank 2 started again alone, the others in their processes (in-place restart 1; 1 of the 3 an hour" \
        in batch_log(root)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((root / "logs").rglob("*_log.err")))
    from_memory = re.findall(r"\[rank (\d)/3 \S+\] INFO checkpoint step \d+: the state from the ranks' memory", logs)
    assert sorted(from_memory) == ["0", "1", "2"], from_memory  # rank 2, started again, got it from a peer
    own = {r: "\n".join(p.read_text(errors="replace") for p in (root / "logs").rglob(f"*_{r}_log.err"))
           for r in (0, 1, 2)}
    for r in (0, 1):  # hpcdist.Context.reruns tells the ranks that lived that they run the job again
        assert f"[rank {r}/3 " in own[r] and "this process runs the job again (1 run before)" in own[r], own[r][-2000:]
    assert "runs the job again (" not in own[2]  # rank 2's new process: its first run
    assert "[rank 2/3 " not in own[0]  # rank 2's new process wrote its own log, not task 0's (the batch log)
    assert own[2].count("INFO group ready: rank 2/3 ") >= 2, own[2][-3000:]  # its first process's run and the new one's
    got = losses(result_path(result.out))
    assert got == reference(root, 3)  # bit for bit, each step once
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("spare").experiment_id])
    logged = {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                                key=lambda m: m.timestamp)}  # a replayed step: its last value
    assert logged == dict(zip(range(1, STEPS + 1), got, strict=True))


def test_a_hung_rank_then_a_communication_error_everywhere_restart_in_place(four_nodes: Path) -> None:
    """3 nodes + 1 spare: rank 1 hangs at step 6 (its node and process alive, its collective never
    entered). The others' all_reduce times out (timeout_s 5) and they say so; rank 1 says nothing
    for 2 s, so the supervisor has it end itself and starts it again alone: ranks 0 and 2 go on in
    their processes. At step 12 every rank raises torch's DistBackendError (what an NCCL error is;
    this machine has no GPU): no rank died, so all run the job again in their processes. One run,
    and every loss bit for bit the uninterrupted run's."""
    root = four_nodes
    job = submit_spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1",
                        "--set", "on_rank_failure=in_place",
                        script=("--hang-rank", "1", "--hang-at", "6", "--comm-error-at", "12"))
    try:
        jid = job_of(job)
        before = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(rank_pids(str(root / "logs"))), 60,
                          "the 3 ranks' processes")
        wait_for(lambda: "started again alone" in batch_log(root), 90, "the in-place restart")
        after = wait_for(lambda: (lambda p: p if len(p) == 3 and p[1] != before[1] else None)(
            rank_pids(str(root / "logs"))), 30, "rank 1's new process")
        result = job.finish(120)
    finally:
        job.kill()
    assert after[0] == before[0] and after[2] == before[2], (before, after)  # ranks 0 and 2: the same processes
    log = batch_log(root)
    assert "in-job: rank 1 said nothing 2 s after the others failed: stuck or hung" in log, log
    assert "rank 1 started again alone, the others in their processes" in log, log
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; 3/3 ranks succeeded" in result.out, result.out
    assert "every rank runs the job again in its process (in-place restart 2; 2 of the 3 an hour" in log, log
    ranks_log = "\n".join(p.read_text(errors="replace") for p in sorted((root / "logs").rglob("*_log.err")))
    for rank in (0, 1, 2):  # rank 1's new process, and ranks 0 and 2 twice in theirs
        assert f"hpcdist: rank {rank} runs the job again in its process (in-job restart 2)" in ranks_log
    # the hung rank said where it was before it ended: in the script's sleep, the line its user looks for
    hung = ranks_log.split("its supervisor ends it, to start it again; where each of its threads was:", 1)
    assert len(hung) == 2 and re.search(r'elastic_sgd\.py", line \d+ in main', hung[1]), ranks_log[-3000:]
    one_run(jid)
    assert read_attrs(result_path(result.out))["resumed_from"] == 11
    assert losses(result_path(result.out)) == reference(root, 3)


def test_a_hung_rank_under_nccls_abort_path_starts_the_step_again(four_nodes: Path) -> None:
    """3 nodes + 1 spare, on_rank_failure left at its default (step): rank 1 hangs at step 6. Its
    peers' all_reduce raises nothing, as under NCCL (gloo made to imitate it, IMITATE_ABORT_VAR):
    their abort watch writes the summary and ends them with exit 124 (HUNG_EXIT), as on a GPU. The
    supervisor takes that for a hang, not for an error of the job's code: every rank starts again
    in a new process on the same nodes. One run, every loss bit for bit the uninterrupted run's."""
    root = four_nodes
    job = submit_spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1",
                        script=("--hang-rank", "1", "--hang-at", "6"), env={IMITATE_ABORT_VAR: "60"})
    try:
        jid = job_of(job)
        result = job.finish(180)
    finally:
        job.kill()
    log = completed_once(jid, result, 3, root)
    assert re.search(r"in-job: rank [02] on n\d ended by a signal \(its collective hung: it ended itself, exit 124\) "
                     r"while every node answers: the step starts again on the same nodes \(in-place restart 1; ",
                     log), log
    assert read_attrs(result_path(result.out))["resumed_from"] == 5
    assert losses(result_path(result.out)) == reference(root, 3)


def test_a_node_whose_ranks_die_twice_gives_them_to_a_spare(four_nodes: Path) -> None:
    """3 nodes + 1 spare, on_rank_failure at its default (step): rank 2's process on n4 is
    SIGKILLed after step 10 with n4 answering: the step starts again on the same nodes. It is
    killed again after step 20: a node whose ranks die twice within 30 min (a GPU's Xid, ECC
    errors, the OOM killer) gets no third chance. n4 is marked with the reason and the step goes
    on on the spare n1 with n2 and n3: one run, every step once, bit for bit."""
    root = four_nodes
    job = submit_spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1", timeout_s=10)
    ckpts = root / "checkpoints" / "elastic_sgd"
    try:
        jid = job_of(job)
        killed_pids: list[int] = []
        for step in (10, 20):
            committed_step(job, ckpts / f"step_{step:08d}.h5")
            pids = wait_for(lambda: (lambda p: p if len(p) == 3 and p[2] not in killed_pids else None)(
                rank_pids(str(root / "logs"))), 30, "the 3 ranks' processes")
            os.kill(pids[2], signal.SIGKILL)
            killed_pids.append(pids[2])
        result = job.finish(180)
    finally:
        job.kill()
    log = completed_once(jid, result, 3, root)
    assert "the step starts again on the same nodes (in-place restart 1; " in log, log
    assert re.search(r"in-job: node n4 is moved off: its ranks go to a spare \(its ranks died by a signal 2 times "
                     r"within 30 min \(the last: Killed\)", log), log
    attrs = read_attrs(result_path(result.out))
    assert attrs["hosts"] == ["n1", "n2", "n3"] and attrs["resumed_from"] >= 20, attrs
    marks = {(m.node, m.source): m.reason for m in health.marks(root / "scratch" / "node-health")}
    assert list(marks) == [("n4", "node_failure")] and "died by a signal 2 times" in marks["n4", "node_failure"]
    assert losses(result_path(result.out)) == reference(root, 3)


def test_a_controller_that_does_not_answer_is_asked_again(four_nodes: Path) -> None:
    """3 nodes + 1 spare: after step 10 the controller stops answering the batch node n1 (its port
    refused there, as while slurmctld restarts or fails over), and n3 dies. The controller's
    silence is not taken for "every node lives": the supervisor asks again, and once it answers
    (the port open again) n3 is found dead and the spare n1 takes its place, in one run."""
    root = four_nodes
    job = submit_spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1")
    try:
        jid = job_of(job)
        committed_step(job, root / "checkpoints" / "elastic_sgd" / "step_00000010.h5")
        with ExitStack() as dead:
            with controller_refused("n1"):  # before n3 dies: the supervisor's first check of n3 finds it silent
                dead.enter_context(killed("n3"))  # revived once the job ended
                wait_for(lambda: "in-job: the Slurm controller does not answer; asking again" in batch_log(root), 60,
                         "the supervisor's line on the controller")
                time.sleep(4)  # a few of its questions go unanswered
            result = job.finish(180)
    finally:
        job.kill()
    assert_went_on(jid, result, ["n1", "n2", "n4"], ["n3"], root)
    log = batch_log(root)
    assert "the Slurm controller still does not answer" not in log  # it answered within the supervisor's wait
    assert "every node of the step answers: going on" not in log and "on the same nodes" not in log, log[-3000:]
    assert losses(result_path(result.out)) == reference(root, 3)


def test_a_dead_spare_is_passed_over(four_nodes: Path) -> None:
    """2 nodes + 2 spares: the step on n2 and n3, spares n4 then n1. n4 dies idle, then n3: the
    supervisor finds n4 dead too and takes n1."""
    root = four_nodes
    jid, result = spared(root, "--set", "resources.nodes=2", "--set", "resources.spare_nodes=2", kills=("n4", "n3"))
    assert_went_on(jid, result, ["n1", "n2"], ["n3", "n4"], root)
    assert losses(result_path(result.out)) == reference(root, 2)


def test_a_second_death_during_recovery_shrinks_the_job_in_place(four_nodes: Path) -> None:
    """3 nodes + 1 spare, min_nodes 2: n3 dies, and n4 as the supervisor restarts the step. No
    spare is left: the job goes on at 2 nodes in the same allocation, still one run."""
    root = four_nodes
    jid, result = spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1",
                         "--set", "resources.min_nodes=2", kills=("n3", "n4"), between="in-job: node {node} died")
    attrs = assert_went_on(jid, result, ["n1", "n2"], ["n3", "n4"], root)
    assert attrs["ran_with"] == 2, attrs
    got, want = losses(result_path(result.out)), reference(root, 3)
    step = int(attrs["resumed_from"])
    assert got[:step] == want[:step]  # the steps of 3 ranks, bit for bit; then 2 ranks' rounding
    assert all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(got, want, strict=True))


def test_no_spare_left_and_no_shrinking_falls_back_to_slurms_requeue(four_nodes: Path) -> None:
    """3 nodes + 1 spare, no min_nodes, on_node_failure requeue: n3 dies, then n4 as the
    supervisor restarts. The job may not run on 2 nodes: Slurm's requeue, as without spares; it
    runs again once the nodes are back (revived here, its hold lifted) and resumes bit for bit."""
    root = four_nodes
    job = submit_spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1",
                        "--set", "on_node_failure=requeue")
    try:
        jid = job_of(job)
        committed_step(job, root / "checkpoints" / "elastic_sgd" / "step_00000010.h5")
        with ExitStack() as dead:
            dead.enter_context(killed("n3"))
            wait_for(lambda: "in-job: node n3 died" in batch_log(root), 60, "the supervisor's line on n3")
            dead.enter_context(killed("n4"))
            wait_for(lambda: "requeued (on_node_failure: requeue)" in batch_log(root), 60, "the supervisor's requeue")
            wait_for(lambda: queue_state(jid).startswith("PENDING"), 60, "the job back in the queue")
        if queue_state(jid).startswith("PENDING"):  # n3 and n4 revived: the 4 nodes it asks for are there
            subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], check=False)  # Slurm's hold
        result = job.finish(180)
    finally:
        job.kill()
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; 3/3 ranks succeeded" in result.out, result.out
    shown = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True).stdout
    assert " Restarts=1 " in shown, shown  # requeued once (accounting keeps only the last run of a resized job)
    assert len(re.findall(r"hpcdist: in-job step 0 on ", batch_log(root))) == 2  # the supervisor of each run
    said = "node n4 died and the job has no live spare left; it may not run on fewer than 3 nodes"
    assert said in batch_log(root), batch_log(root)[-3000:]
    assert losses(result_path(result.out)) == reference(root, 3)


def test_spares_are_asked_for_and_checked() -> None:
    """The script asks Slurm for the spares and keeps the job alive through a node's death
    (--no-kill); the supervisor runs the launch. A spare beyond the partition, or on a site
    without Slurm, is one line naming the key."""
    base = ("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "resources.nodes=3")
    script = run_cli(*base, "--set", "resources.spare_nodes=1")
    assert script.code == 0, script.text
    assert "#SBATCH --nodes=4\n" in script.out and "#SBATCH --no-kill\n" in script.out
    assert re.search(r"\n\S+python\S* -P -m hpcdist\.runtime\.in_job \S+ -- srun ", script.out), script.out
    assert "--no-kill" not in run_cli(*base).out
    too_many = run_cli(*base, "--set", "resources.spare_nodes=2")
    assert too_many.code == 2 and "resources.spare_nodes: 2" in too_many.err and "at most 1" in too_many.err
    assert len(too_many.err.strip().splitlines()) == 1, too_many.err
    local = run_cli("render", "jobs/smoke.yaml", "--site", "local", "--set", "resources.spare_nodes=1")
    assert local.code == 2 and "resources.spare_nodes" in local.err, local.err


def sgd_function(steps: int) -> dict[str, object]:
    """elastic_sgd.py's loop as a function given to hpcdist.Executor: checkpoints every step,
    resumes from the latest; returns where it resumed and every step's loss."""
    import time

    import torch
    import torch.distributed as dist

    from tests.scripts.elastic_sgd import BATCH, FEATURES, batch

    ctx = hpcdist.init()
    w, start, losses = torch.zeros(FEATURES, 1, dtype=torch.float64), 0, []
    latest = ctx.checkpoints.load_latest()
    if latest is not None:
        start, state = latest
        w, losses = state["w"].clone(), state["losses"].tolist()
    for step in range(start + 1, steps + 1):
        x, y = batch(step)
        x, y = x[ctx.rank::ctx.world_size], y[ctx.rank::ctx.world_size]
        err = x @ w - y
        both = torch.cat([(2 * x.T @ err).flatten(), (err**2).sum().reshape(1)]) / BATCH
        dist.all_reduce(both)
        w -= 0.1 * both[:-1].reshape(FEATURES, 1)
        losses.append(float(both[-1]))
        ctx.checkpoints.save(step, {"w": w, "losses": torch.tensor(losses, dtype=torch.float64)})
        time.sleep(0.25)
    return {"resumed_from": start, "losses": losses, "host": ctx.hosts[ctx.rank]}


def test_an_executor_function_goes_on_on_the_spare(four_nodes: Path) -> None:
    """hpcdist.Executor(nodes=2, spare_nodes=1) on n1, n3, n4: the step runs on n3 and n4, the
    batch node n1 waits. n3 dies after step 10: rank 0's node, which hosted the store every rank
    met at. The function goes on on n1 and n4, rank 0 and the new rendezvous on n1."""
    root = four_nodes
    ex = hpcdist.Executor(site="local-slurm", nodes=2, spare_nodes=1, tasks_per_node=1, time_min=5, timeout_s=10,
                          set={**{f"site.storage.{k}": str(root / k) for k in ("results", "checkpoints", "scratch",
                                                                                 "logs")},
                               "sbatch.nodelist": "n1,n3,n4"})
    job = ex.submit(sgd_function, STEPS)
    ckpts = Path(wait_for(lambda: next(iter((root / "checkpoints").glob("*/step_00000010.h5")), None), 120,
                          "step 10's checkpoint")).parent
    with killed("n3"):
        values = job.results()
    assert job.state is hpcdist.JobState.COMPLETED
    assert [v["host"] for v in values] == ["n1", "n4"]
    assert 10 <= values[0]["resumed_from"] < STEPS  # type: ignore[operator]
    assert values[0]["losses"] == values[1]["losses"] == reference(root, 2)  # bit for bit, each step once
    one_run(job.job_id)
    assert ckpts.exists()


def test_spares_are_counted_where_marked_nodes_are_excluded(tmp_path: Path) -> None:
    """A node marked bad (as any node death leaves it, for health.exclude_for_h) leaves 3 of the 4
    nodes: a job of 3 nodes + 1 spare no longer fits. `hpcdist submit` says so in one line naming
    the mark, the spare and what to set, before sbatch (which said "Requested node configuration
    is not available")."""
    from hpcdist.scheduler.slurm_cluster import node_states

    states = node_states()
    assert states is not None, "sinfo could not be asked"
    members = [n for n, st in states.items() if "cpu" in st.partitions]
    store = storage_sets(tmp_path)
    marked = run_cli("nodes", "--site", "local-slurm", *store, "--mark", members[-1], "--reason", "ECC errors")
    assert marked.code == 0, marked.text
    short = run_cli("submit", "jobs/smoke.yaml", "--site", "local-slurm", *store,
                    "--set", f"resources.nodes={len(members) - 1}", "--set", "resources.spare_nodes=1")
    assert short.code == 2 and len(short.err.strip().splitlines()) == 1 and "submitted" not in short.out, short.text
    assert (f"would leave {len(members) - 1} of partition cpu's {len(members)} nodes for a job of "
            f"{len(members) - 1} nodes + 1 spare: {members[-1]}: ") in short.err, short.err
    assert "ECC errors" in short.err and "set resources.spare_nodes=0 (fewer spares)" in short.err, short.err


def test_the_batch_nodes_death_is_caught_by_the_standby_job(four_nodes: Path) -> None:
    """2 nodes + 1 spare on n2-n4 (n1 excluded): Slurm runs the batch script and the supervisor on
    n2, which the supervisor gives no rank while it has another spare. n2 dies after step 10.
    Slurm takes it out of the --no-kill job and would leave the job running with no batch script;
    the ranks' connections to the supervisor time out, a rank finds n2's slurmd silent and cancels
    the job, naming n2. Its standby job, queued behind it at submission, takes over on n3 and n4:
    the ranks resume from the last checkpoint, every step's loss once, n2 named and marked.
    `submit --wait` follows the job into its standby; the standby's own standby is gone from the
    queue once it completed."""
    from hpcdist.runtime.standby import read_link
    from tests.test_node_failure import uninterrupted_losses

    root, steps, jid, standby = four_nodes, 60, "", None
    job = Background(["submit", "--site", "local-slurm", "--wait", *storage_sets(root), "--set", "timeout_s=5",
                      "--set", "resources.nodes=2", "--set", "resources.spare_nodes=1", "--set", "sbatch.exclude=n1",
                      "--", str(SCRIPT), "--steps", str(steps), "--every", "1", "--step-s", "0.3"])
    try:
        jid = job_of(job)
        folder = root / "logs" / "elastic_sgd"
        committed_step(job, root / "checkpoints" / "elastic_sgd" / "step_00000010.h5")
        shown = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True).stdout
        assert " BatchHost=n2 " in shown, shown
        standby = read_link(folder / jid / f"{jid}_standby")
        assert standby is not None and queue_state(standby) == "PENDING Dependency"
        with killed("n2"):
            result = job.finish(180)
    finally:
        job.kill()
        subprocess.run(["scancel", *(i for i in (jid, standby) if i)], capture_output=True, check=False)
    assert standby is not None
    log = (folder / standby / f"{standby}_0_log.err").read_text(errors="replace")
    assert result.code == 0, result.text + log[-3000:]
    file = root / "results" / "elastic_sgd" / f"{standby}.h5"
    said = (rf"job {jid} ended CANCELLED: its batch node n2 died, its rank found: its slurmd at \S+ does not answer "
            rf".*; its standby job {standby} runs it on .*, result {file}\)")
    assert re.search(said, result.err), result.err
    assert f"job {standby} finished: COMPLETED; 2/2 ranks succeeded" in result.out, result.out
    assert f"standby job {standby} takes over job {jid}, which ended CANCELLED: its batch node n2 died" in log
    assert history(jid)[0] == "CANCELLED" and history(standby) == ["COMPLETED"]  # no requeue, no NODE_FAIL
    assert re.search(r"ran again without node n2 \(died in run 1, ", result.out), result.out
    attrs = read_attrs(file)
    assert attrs["hosts"] == ["n3", "n4"] and attrs["excluded_nodes"] == "n2", attrs
    assert 10 <= int(str(attrs["resumed_from"])) < steps, attrs
    with h5py.File(file) as f:
        table = read_table(f["loss"])
    assert table["step"].tolist() == list(range(1, steps + 1))  # every step once
    assert all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(table["loss"].tolist(), uninterrupted_losses(steps),
                                                           strict=True))
    assert ("n2", "node_failure") in {(m.node, m.source) for m in health.marks(root / "scratch" / "node-health")}
    chained = read_link(folder / standby / f"{standby}_standby")  # the standby's own, cancelled by Slurm
    assert chained is not None
    wait_for(lambda: not queue_state(chained), 30, f"job {chained} gone from the queue")


def test_train_gpt_restarted_in_place_reads_no_checkpoint_file(four_nodes: Path, tokens: Path) -> None:
    """train_gpt on 3 nodes + 1 spare (a checkpoint every step), rank 2's process killed after
    step 10: restarted in place, every rank takes the last committed step from the memory of the
    ranks that lived (the one CheckpointManager's rule: the newest committed step, from memory when
    the ranks hold it), and no process opens a checkpoint file from rank 2's new start until every
    rank has resumed (inotify on the shared folder: the nodes share this machine's file system;
    before that, rank 0's in-flight save may still prune). Every step once, COMPLETED in one run."""
    from tests.support.opens import Opens
    from tests.support.train import ckpt_dir, train_args

    root, steps = four_nodes, 40
    job = Background(train_args(root, tokens, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1",
                                "--set", "resources.tasks_per_node=1", "--set", "on_rank_failure=in_place",
                                "--set", f"params.steps={steps}", "--set", "params.checkpoint.every=1",
                                "--set", "params.log_every=5", "--set", "timeout_s=10", site="local-slurm"),
                     env={"SLURM_WAIT": "1"})
    opens: Opens | None = None
    try:
        jid = job_of(job)

        def committed() -> int:  # the step `latest` names (a checkpoint every step: step 10's file is soon pruned)
            if job.proc.poll() is not None:
                raise AssertionError(f"the job ended before step 10: {job.finish(10).text}")
            try:
                return int((ckpt_dir(root) / "latest").read_text().split()[-1][5:13])
            except (OSError, ValueError, IndexError):
                return 0

        wait_for(lambda: committed() >= 10, 120, "step 10's checkpoint")
        before = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(rank_pids(str(root / "logs"))), 30,
                          "the 3 ranks' processes")
        os.kill(before[2], signal.SIGKILL)
        wait_for(lambda: rank_pids(str(root / "logs")).get(2, before[2]) != before[2], 60, "rank 2's new process")
        opens = Opens(ckpt_dir(root))  # from rank 2's new start: the in-flight save of rank 0 is over
        started = time.time()
        result = job.finish(180)
    finally:
        job.kill()
        stamped = opens.close() if opens is not None else []
    completed_once(jid, result, 3, root)
    resumed = []
    for r in (0, 1, 2):
        log = "\n".join(p.read_text(errors="replace") for p in sorted((root / "logs").rglob(f"*_{r}_log.err")))
        lines = re.findall(r"^(\S+ \S+) \[rank \d/3 [^]]*\] INFO resumed from \S+step_(\d{8})\.h5: step \d+, "
                           r".*\((.*)\)$", log, re.M)
        assert len(lines) == 1 and lines[0][2] == "from the ranks' memory, no file read", (r, lines, log[-3000:])
        resumed.append(datetime.strptime(lines[0][0], "%Y-%m-%d %H:%M:%S,%f").timestamp())
    window = [name for at, name in stamped if started <= at <= max(resumed) + 0.001]
    read = [name for name in window if re.fullmatch(r"step_\d{8}\.h5", name)]
    assert read == [], read
    with h5py.File(result_path(result.out)) as f:
        assert read_table(f["train/steps"])["step"].tolist() == list(range(1, steps + 1))  # each step once
        ops = [op.decode() if isinstance(op, bytes) else str(op) for op in read_table(f["train/checkpoints"])["op"]]
    assert "memory" in ops and "read" not in ops, ops

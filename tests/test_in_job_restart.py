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

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import h5py
import pytest

import hpcdist
from hpcdist.store.records import health
from hpcdist.store.results import read_attrs, read_table
from tests.netfault import killed, revive
from tests.support.cli import Run, result_path, run_cli, storage_sets
from tests.support.train import Background, wait_for
from tests.test_node_failure import SCRIPT, committed_step, history, job_of

STEPS = 30


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


def reference(root: Path, ranks: int) -> list[float]:
    """The same script uninterrupted at `ranks` ranks (the local site: the same gloo sums)."""
    ref = run_cli("submit", "--site", "local", "--wait", *storage_sets(root / "reference"),
                  "--set", f"resources.tasks_per_node={ranks}", "--", str(SCRIPT), "--steps", str(STEPS))
    assert ref.code == 0, ref.text
    return losses(result_path(ref.out))


def spared(root: Path, *sets: str, kills: tuple[str, ...], between: str = "") -> tuple[str, Run]:
    """elastic_sgd.py with spares; `kills` killed after its 10th checkpoint, each after the
    supervisor's line `between` names the one before (at once when "")."""
    job = Background(["submit", "--site", "local-slurm", "--wait", *storage_sets(root), "--set", "timeout_s=10",
                      *sets, "--", str(SCRIPT), "--steps", str(STEPS), "--every", "1", "--step-s", "0.25"])
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


def test_a_dead_node_is_replaced_by_the_spare_in_the_same_allocation(four_nodes: Path) -> None:
    """3 nodes + 1 spare (all four): the step runs on n2-n4, n1 (the batch node) waits; n3 dies."""
    root = four_nodes
    jid, result = spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1", kills=("n3",))
    attrs = assert_went_on(jid, result, ["n1", "n2", "n4"], ["n3"], root)
    assert 10 <= attrs["resumed_from"] < STEPS and attrs["ran_with"] == 3, attrs
    assert losses(result_path(result.out)) == reference(root, 3)  # bit for bit


def test_rank_0s_node_dies_and_the_spare_hosts_the_new_rendezvous(four_nodes: Path) -> None:
    """n2 runs rank 0 and the store its ranks rendezvous at: the new step's rank 0 is on n1."""
    root = four_nodes
    jid, result = spared(root, "--set", "resources.nodes=3", "--set", "resources.spare_nodes=1", kills=("n2",))
    assert_went_on(jid, result, ["n1", "n3", "n4"], ["n2"], root)
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
    batch node n1 waits; n3 dies after step 10 and the function goes on on n1 and n4."""
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

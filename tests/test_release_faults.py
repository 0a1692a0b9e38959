"""Issue 63, item 2: node and rank faults on each Slurm release of the test bed (cluster/releases.sh),
as the ordinary user alice with no site written, through ``hpcdist submit --wait``. The same faults
on the 22.05 cluster's nodes of their own network: tests/test_in_job_restart.py and
tests/test_node_failure.py, whose script (tests/scripts/elastic_sgd.py, the loss of every step
recorded, the same at any world size) and checks these reuse.

A release has two nodes, single-host (one machine, each slurmd in a mount namespace of its own), so
one node's death serves two jobs that run at once on both nodes:

- **hot spares**: 1 node x 2 tasks + 1 spare. The supervisor gives the ranks to the node that is not
  the batch node; the batch node is the spare. After step 5 a rank's process is SIGKILLed (its node
  lives): the step starts again on the same node. Then that node dies: the spare takes its ranks.
  COMPLETED in the job's first run, every step's loss once.
- **a requeue**: 2 nodes x 1 task, no spare, ``on_node_failure: requeue`` and ``min_nodes: 1``. The
  same death: Slurm declares the node DOWN after SlurmdTimeout and requeues the job; the waiter
  excludes the node and shrinks the job to the node that lives; it resumes from its checkpoint and
  the postmortem names the node (``ran again without node t2 (died in run 1, ...``).

Both jobs wait before a step of theirs (the script's ``--wait-at``) until the node is dead, so the
fault lands while both run, whatever the machine's load (a requeued job that ran ahead had finished
before it in one run of five under load).

A node dies as ``releases.sh kill`` makes it (its slurmd's port silent, every process of its mount
namespace killed) and is revived after the test, even one that fails. Slurm holds a requeued job
for about two minutes (BeginTime); the test starts it once the node is excluded, as root, as the
suite's 22.05 tests do."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest

from hpcdist.store.records import health
from hpcdist.store.results import read_attrs, read_table
from tests.support.cli import REPO, Run, rank_pids
from tests.support.members import Member
from tests.support.releases import NODES, RELEASES, alice_on, release_env
from tests.support.train import wait_for
from tests.test_node_failure import uninterrupted_losses

pytestmark = [pytest.mark.slurm, pytest.mark.other_clusters]  # a group beside the main cluster's

RELEASES_SH = REPO / "cluster" / "releases.sh"
SCRIPT = REPO / "tests" / "scripts" / "elastic_sgd.py"
WAIT = 240
# Steps of each job, and the step each waits before until the test has killed the node (the file
# GO exists): the spared job's rank is killed at step 5 or later and its step starts again before
# then, and the requeued job's last 30 steps run after the requeue, however loaded the machine.
STEPS, GATE, GO = {"spared": 30, "requeued": 40}, {"spared": 15, "requeued": 10}, "go"
SPARED = ("--set", "resources.nodes=1", "--set", "resources.tasks_per_node=2", "--set", "resources.spare_nodes=1")
REQUEUED = ("--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1", "--set", "resources.min_nodes=1",
            "--set", "on_node_failure=requeue")


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def alice(release: str) -> Iterator[Member]:
    for node in NODES[release]:  # a test that died may have left one dead
        releases_sh("revive", release, node)
    yield from alice_on(release, "faults", {"elastic_sgd.py": SCRIPT.read_text()}, own_index=True)


def releases_sh(*argv: str) -> None:
    done = subprocess.run(["bash", str(RELEASES_SH), *argv], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"cluster/releases.sh {' '.join(argv)}: {done.stderr}"


def slurm(release: str, *argv: str) -> str:
    """A command of the release's own, as root (the test is the admin who releases a held job)."""
    done = subprocess.run(argv, env=release_env(release), capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def field(release: str, jid: str, name: str) -> str:
    """A field of ``scontrol show job``; "" where Slurm says (null)."""
    found = re.search(rf"\b{name}=(\S+)", slurm(release, "scontrol", "-o", "show", "job", jid))
    return "" if found is None or found[1] == "(null)" else found[1]


def history(release: str, jid: str) -> list[str]:
    """The job's states in the release's accounting, one per run."""
    return slurm(release, "sacct", "-j", jid, "-X", "-n", "-P", "--duplicates", "-o", "State").split()


class Submitted:
    """alice's `hpcdist submit --wait` of elastic_sgd.py (a checkpoint every step) as job `name`."""

    def __init__(self, alice: Member, name: str, *sets: str) -> None:
        self.name, self.out = name, alice.folder / "hpcdist-out"
        self.proc = alice.start("hpcdist", "submit", "--wait", "--set", f"name={name}", "--set", "timeout_s=5", *sets,
                                "--", "elastic_sgd.py", "--steps", str(STEPS[name]), "--every", "1", "--step-s", "0.25",
                                "--wait-at", str(GATE[name]), "--wait-for", str(alice.folder / GO))
        self.first = ""

    def job_id(self) -> str:
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline()  # "submitted job J (...)"
        found = re.search(r"submitted job (\d+)", self.first)
        assert found, self.first + (self.proc.communicate(timeout=30)[1] if not self.first else "")
        self.jid = found[1]
        return self.jid

    def log(self) -> str:
        """Task 0's log: the batch script's lines (the in-job supervisor's) and rank 0's."""
        return "\n".join(p.read_text(errors="replace") for p in (self.out / "logs" / self.name).glob("*/*_0_log.err"))

    def step(self) -> int:
        """The last committed checkpoint's step (0 before the first)."""
        latest = self.out / "checkpoints" / self.name / "latest"
        found = re.findall(r"step_(\d+)", latest.read_text() if latest.exists() else "")
        return int(found[-1]) if found else 0

    def finish(self) -> Run:
        out, err = self.proc.communicate(timeout=WAIT)
        return Run(self.proc.returncode, self.first + out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def result(self) -> Path:
        return self.out / "results" / self.name / f"{self.jid}.h5"

    def losses(self) -> list[float]:
        """Every step's loss, each step once, as one process computes them on the whole batch."""
        with h5py.File(self.result()) as f:
            table = read_table(f["loss"])
        steps = STEPS[self.name]
        assert table["step"].tolist() == list(range(1, steps + 1)), table["step"].tolist()
        got, want = table["loss"].tolist(), uninterrupted_losses(steps)
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(got, want, strict=True)), (got, want)
        return got


def test_a_killed_rank_and_a_dead_node_go_on_with_a_spare_and_in_a_requeue(release: str, alice: Member) -> None:
    """Two jobs at once on the release's two nodes, and one node's death under both: the spared
    job's ranks go to its spare (after a killed rank started its step again), the other job is
    requeued by Slurm, shrunk by the waiter, resumed, and its summary names the node."""
    spared, requeued = Submitted(alice, "spared", *SPARED), Submitted(alice, "requeued", *REQUEUED)
    dead = ""
    try:
        spared.job_id(), requeued.job_id()
        wait_for(lambda: spared.step() >= 5, WAIT, "the spared job's step 5")
        logs = str(spared.out / "logs" / "spared")
        ranks = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(rank_pids(logs)), 30, "its 2 ranks' processes")
        os.kill(ranks[1], signal.SIGKILL)  # its node lives
        wait_for(lambda: "INFO resumed from step" in spared.log(), 60, "the spared job's step started again")
        batch = field(release, spared.jid, "BatchHost")  # its spare; its ranks run on the other node
        [dead] = [n for n in NODES[release] if n != batch]
        wait_for(lambda: spared.step() == GATE["spared"] - 1 and requeued.step() == GATE["requeued"] - 1, WAIT,
                 "both jobs waiting at their steps")
        releases_sh("kill", release, dead)
        (alice.folder / GO).touch()  # go on: the spared job on its spare, the requeued one into its dead peer

        seen: list[str] = []

        def excluded() -> bool:  # Slurm requeued it (NODE_FAIL, after SlurmdTimeout) and the waiter excluded the node
            state, refused = slurm(release, "squeue", "-h", "-j", requeued.jid, "-o", "%T"), field(
                release, requeued.jid, "ExcNodeList")
            seen[:] = [f"{state or 'not in the queue'}, excluded {refused or 'none'}"]
            return state == "PENDING" and dead in refused

        try:
            wait_for(excluded, 150, f"the requeued job pending with {dead} excluded", poll=0.5)
        except AssertionError as exc:  # what Slurm and the waiter said, for the failure's reader
            requeued.kill()
            out, err = requeued.proc.communicate(timeout=30)
            raise AssertionError(f"{exc}; last seen: {seen}; runs in accounting: {history(release, requeued.jid)}; "
                                 f"{dead}: {slurm(release, 'scontrol', '-o', 'show', 'node', dead)[:300]}; "
                                 f"its waiter said: {requeued.first}{out[-1500:]}{err[-2500:]}; its log: "
                                 f"{requeued.log()[-2500:]}") from None
        time.sleep(2)  # not within a second of the requeue: the old run's credential (tests/support/train.py)
        slurm(release, "scontrol", "update", f"JobId={requeued.jid}", "StartTime=now")  # Slurm holds it ~2 min
        went_on, ran_again = spared.finish(), requeued.finish()
    finally:
        spared.kill()
        requeued.kill()
        if dead:
            releases_sh("revive", release, dead)
    [live] = [n for n in NODES[release] if n != dead]

    # hot spares: one run; the killed rank's step again on its node, then the dead node's ranks on the spare
    log = spared.log()
    assert went_on.code == 0, went_on.text + log[-3000:]
    assert f"job {spared.jid} finished: COMPLETED; 2/2 ranks succeeded" in went_on.out, went_on.out
    assert re.search(rf"ran again without node {dead} \(died in run 1, ", went_on.out), went_on.out
    assert re.findall(r'rank \d: ok \{"host": "(\w+)"', went_on.out) == [batch, batch], went_on.out
    assert "the step starts again on the same nodes (in-place restart 1; " in log, log[-3000:]
    assert re.search(rf"hpcdist: in-job: node {dead} died \(its slurmd at 127\.0\.0\.1:\d+ does not answer", log), log
    states = history(release, spared.jid)
    assert states[-1] == "COMPLETED" and set(states) <= {"RESIZING", "COMPLETED"}, states  # no NODE_FAIL, no requeue
    attrs = read_attrs(spared.result())
    assert attrs["hosts"] == [batch, batch] and attrs["world_size"] == 2 and attrs["excluded_nodes"] == dead, attrs
    assert attrs["resumed_from"] >= 5 and attrs["ran_with"] == 2, attrs
    spared.losses()

    # the requeue: Slurm's NODE_FAIL, the waiter's exclusion and shrink, resumed on the node that lives
    assert ran_again.code == 0, ran_again.text + requeued.log()[-3000:]
    assert f"job {requeued.jid} finished: COMPLETED; 1/1 ranks succeeded" in ran_again.out, ran_again.out
    assert re.search(rf"ran again without node {dead} \(died in run 1, ended \S+; excluded at ", ran_again.out)
    assert (f"job {requeued.jid}: node {dead} died (run 1 ended NODE_FAIL at " in ran_again.err
            and f"it runs again without it, on 1 of its 2 nodes (live and not excluded: {live})" in ran_again.err), \
        ran_again.err
    assert history(release, requeued.jid) == ["NODE_FAIL", "COMPLETED"]
    attrs = read_attrs(requeued.result())
    assert attrs["hosts"] == [live] and attrs["world_size"] == 1 and attrs["excluded_nodes"] == dead, attrs
    assert attrs["resumed_from"] >= 5 and attrs["ran_with"] == 1, attrs
    requeued.losses()
    listed = alice.hpcdist("jobs", "--json")
    assert listed.code == 0, listed.err
    row = next(j for j in json.loads(listed.out) if j["job_id"] == requeued.jid)
    assert row["state"] == "COMPLETED" and row["excluded"].startswith(f"{dead} (died in run 1"), row

    marked = {(m.node, m.source) for m in health.marks(spared.out / "scratch" / "node-health")}
    assert marked == {(dead, "node_failure")}, marked

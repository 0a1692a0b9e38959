"""Issue 63, item 2: the rest of hpcdist's front doors on each Slurm release of the test bed
(cluster/releases.sh; tests/test_slurm_releases.py has submit, result, map_array, smoke under srun
and site init/check), as the ordinary user alice with no site written by hand:

- a submitit user's ``AutoExecutor``: a running job cancelled, and a ``Checkpointable`` stopped by
  its time limit, requeued, and resumed with its state;
- ``hpcdist submit --wait`` of jobs/smoke.yaml on 2 nodes with every launcher: srun with PMIx
  (where the release's ``srun --mpi=list`` has it), mpirun and torchrun;
- a 2-node train_gpt preempted as Slurm preempts (``scontrol requeue``) and resumed, its loss going
  on from where it stopped; ``hpcdist jobs``, ``logs`` and ``cancel`` on jobs of the release.

Each test runs its jobs at once where the release's two nodes hold them. A requeued job is held by
Slurm for about two minutes (BeginTime); the tests release it as the suite's 22.05 tests do
(``scontrol update StartTime=now``, as root). Hot spares and node death on the releases:
tests/test_release_faults.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.cli import REPO, Run
from tests.support.members import NO_SITE_LINE, Member
from tests.support.releases import CLUSTERS, NODES, RELEASES, alice_on, release_env
from tests.support.train import TINY, wait_for, write_corpus

pytestmark = [pytest.mark.slurm, pytest.mark.other_clusters]  # a group beside the main cluster's

WAIT = 300  # other tests' jobs share the machine and the release's two nodes: generous

# A submitit user's script: a job cancelled while it runs, and a Checkpointable that counts until
# its time limit's signal stops it; requeued, it comes back with its count and returns it.
EXECUTOR = """\
import time
from pathlib import Path

import hpcdist
from submitit.helpers import Checkpointable


class Counter(Checkpointable):
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        if self.count:  # requeued: resumed with the state it had when it was stopped
            return self.count
        while True:
            self.count += 1
            time.sleep(1)


def sleep(seconds: int) -> str:
    time.sleep(seconds)
    return "slept"


ex = hpcdist.AutoExecutor("log_%j")
ex.update_parameters(timeout_min=1, signal_delay_s=20)
counter = ex.submit(Counter())
Path("counter.id").write_text(counter.job_id)
ex.update_parameters(timeout_min=5)
sleeper = ex.submit(sleep, 600)
while sleeper.state != "RUNNING":
    time.sleep(1)
sleeper.cancel()
try:
    print("sleeper", sleeper.result())
except Exception as error:
    print("sleeper", type(error).__name__, sleeper.state)
print("counter", counter.result(), counter.state)
"""
SLEEPER = "import time\nprint('sleeping now', flush=True)\ntime.sleep(600)\n"


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def alice(release: str) -> Iterator[Member]:
    yield from alice_on(release, "doors", {"executor.py": EXECUTOR, "sleeper.py": SLEEPER}, own_index=True)


def slurm(release: str, *argv: str) -> str:
    """A command of the release's own, as root (the test is the admin who preempts and releases)."""
    env = release_env(release)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def release_if_held(release: str, jid: str) -> bool:
    """Start job `jid` now if Slurm holds it after a requeue (BeginTime); whether it did."""
    if slurm(release, "squeue", "-h", "-j", jid, "-o", "%T %r") != "PENDING BeginTime":
        return False
    time.sleep(2)  # not at once: a restart within the second of the requeue finds its credential revoked
    slurm(release, "scontrol", "update", f"JobId={jid}", "StartTime=now")
    return True


def finish(proc: subprocess.Popen[str], timeout: float = WAIT) -> Run:
    out, err = proc.communicate(timeout=timeout)
    return Run(proc.returncode, out, err)


def history(release: str, jid: str) -> list[str]:
    """The job's states in the release's accounting, one per run."""
    return slurm(release, "sacct", "-j", jid, "-X", "-n", "-P", "--duplicates", "-o", "State").split()


def smoke(alice: Member, launcher: str) -> Run:
    """jobs/smoke.yaml on 2 nodes x 1 task with `launcher` (three at once fit the release's nodes)."""
    return alice.hpcdist("submit", "--wait", "smoke.yaml", "--set", "resources.nodes=2",
                         "--set", "resources.tasks_per_node=1", "--set", f"site.launcher.kind={launcher}", timeout=WAIT)


def ranks_ok(ran: Run, release: str) -> str:
    """The smoke job's summary said it ran on both nodes of the release; its rank 0's log."""
    assert ran.code == 0, ran.out + ran.err
    assert f"to site {CLUSTERS[release]}" in ran.out and "COMPLETED; 2/2 ranks succeeded" in ran.out, ran.out
    hosts = {line.split('"host": "')[1].split('"')[0] for line in ran.out.splitlines() if '"host": "' in line}
    assert hosts == set(NODES[release]), ran.out
    return ran.out


def test_autoexecutor_cancel_checkpointable_and_smoke_with_every_launcher(release: str, alice: Member) -> None:
    """A submitit user's script, and meanwhile (while its Counter waits for its time limit) the
    smoke job with srun, mpirun and torchrun. srun's steps start with PMIx where the release's srun
    has it: the site discovery wrote says so (tests/test_slurm_releases.py)."""
    pmix = "pmix" in slurm(release, "srun", "--mpi=list").split()
    script = alice.start("python", "executor.py")
    try:
        with ThreadPoolExecutor(3) as pool:
            ran = {kind: pool.submit(smoke, alice, kind) for kind in ("srun", "mpirun", "torchrun")}
        jid = wait_for(lambda: (alice.folder / "counter.id").is_file() and (alice.folder / "counter.id").read_text(),
                       WAIT, "the Counter's job id")

        def ended() -> bool:  # Slurm may stop it more than once: its signal may come up to a minute early
            release_if_held(release, jid)
            return script.poll() is not None

        wait_for(ended, 2 * WAIT, "the script to end", poll=1)
        executed = finish(script)
    finally:
        script.kill()
    # each rank took its rank as its launcher gave it: srun's PMIx server (PMIX_RANK) or Slurm's, Open MPI's, torchrun's
    for kind, table in (("srun", "pmix" if pmix else "slurm"), ("mpirun", "openmpi"), ("torchrun", "torchrun")):
        job = re.search(r"submitted job (\d+)", ranks_ok(ran[kind].result(), release))
        shown = alice.hpcdist("logs", job[1]).out if job else ""
        assert re.search(rf"group ready: rank \d/2 .* via {table},", shown), (kind, shown)

    assert executed.code == 0, executed.err
    assert NO_SITE_LINE in executed.err and "Traceback" not in executed.err, executed.err
    assert "sleeper JobUncompleted CANCELLED" in executed.out, executed.out
    counted = re.search(r"^counter (\d+) COMPLETED$", executed.out, re.M)
    assert counted and int(counted[1]) > 0, executed.out  # a fresh Counter would count for ever
    states = history(release, jid)
    assert states[-1] == "COMPLETED" and set(states[:-1]) == {"REQUEUED"} and len(states) >= 2, states


def loss_at(log: str, step: int) -> float:
    found = re.findall(rf"step {step}/400 .*?loss (\d+\.\d+)", log)
    assert found, log[-3000:]
    return float(found[-1])


def test_train_gpt_preempted_and_resumed_then_jobs_logs_and_cancel(release: str, alice: Member) -> None:
    write_corpus(alice.folder / "corpus.txt", words=6000)
    shutil.chown(alice.folder / "corpus.txt", "alice", "alice")
    made = alice.hpcdist("data", "prepare", "corpus.txt", "-o", "tokens.h5")
    assert made.code == 0, made.err
    logs = alice.folder / "hpcdist-out" / "logs" / "train_gpt"
    train = alice.start("hpcdist", "submit", "--wait", str(REPO / "jobs" / "train_gpt.yaml"),
                        "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1",
                        "--set", f"params.data={alice.folder / 'tokens.h5'}", *TINY)
    try:
        def rank0() -> str:
            return "".join(p.read_text() for p in sorted(logs.glob("*/train_rank0.log")))

        wait_for(lambda: "step 20/400" in rank0(), WAIT, "step 20 in rank 0's log")
        jid = next(p.name for p in logs.iterdir() if p.name.isdigit())
        slurm(release, "scontrol", "requeue", jid)  # as Slurm's PreemptMode=REQUEUE: SIGTERM, then requeued
        wait_for(lambda: release_if_held(release, jid), 60, "the requeued job held (PENDING BeginTime)")

        # meanwhile, a user's commands on another job of the release
        sleeper = alice.hpcdist("submit", "--", "sleeper.py")
        assert sleeper.code == 0, sleeper.err
        other = re.search(r"submitted job (\d+)", sleeper.out)
        assert other, sleeper.out
        wait_for(lambda: "sleeping now" in alice.hpcdist("logs", other[1]).out, WAIT, "the sleeper's first line", 2)
        assert row(alice, other[1])[:5] == [other[1], "sleeper", "python", CLUSTERS[release], "RUNNING"]
        cancelled = alice.hpcdist("cancel", other[1])
        assert cancelled.out.startswith(f"cancelled job {other[1]} (sleeper) on site {CLUSTERS[release]}"), cancelled
        wait_for(lambda: row(alice, other[1])[4] == "CANCELLED", WAIT, "CANCELLED in `hpcdist jobs`", 2)

        trained = finish(train)
    finally:
        train.kill()
    assert trained.code == 0, trained.out[-3000:] + trained.err[-3000:]
    assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in trained.out, trained.out[-3000:]
    assert history(release, jid) == ["REQUEUED", "COMPLETED"]
    assert row(alice, jid)[:5] == [jid, "train_gpt", "train_gpt", CLUSTERS[release], "COMPLETED"]
    shown = alice.hpcdist("logs", jid).out  # rank 0's log, both runs
    stopped = re.search(r"TERM signal received: checkpointing at step (\d+)", shown)
    assert stopped, shown[-3000:]
    step = int(stopped[1])
    assert f"resumed from {alice.folder}/hpcdist-out/checkpoints/train_gpt/step_{step:08d}.h5: step {step}" in shown
    # the loss goes on from where it stopped: the first logged after the resume is nearer the last
    # before the stop than the first of the run (a fresh model's)
    first, before, after = (loss_at(shown, s) for s in (10, step // 10 * 10, (step // 10 + 1) * 10))
    assert after < (first + before) / 2, (first, before, after)


def row(alice: Member, jid: str) -> list[str]:
    """The job's row of alice's `hpcdist jobs`."""
    listed = alice.hpcdist("jobs")
    assert listed.code == 0, listed.err
    rows = [r.split() for r in listed.out.splitlines() if r.split()[:1] == [jid]]
    assert len(rows) == 1, listed.out
    return rows[0]

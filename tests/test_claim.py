"""The checkpoint directory's claim (``hpcdist.store.checkpoint.claim``): taken back only by a later start of
the same job step or from a holder proven gone, atomically, and never on silence."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from hpcdist.errors import CheckpointError
from hpcdist.scheduler import slurm
from hpcdist.store.checkpoint import claim as claim_mod
from hpcdist.store.checkpoint.claim import Claim, Holder, read
from tests.support.cli import require_slurm


def here(job: str, pid: int | None = None, **kw: object) -> Holder:
    return Holder(job, socket.gethostname(), os.getpid() if pid is None else pid, time.time(), **kw)  # type: ignore[arg-type]


def running_job(command: str) -> str:
    require_slurm()
    return subprocess.run(["sbatch", "--parsable", "-p", "cpu", "-o", "/dev/null", "--wrap", command],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def wait_step(job: str, step: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if step in (slurm.job_steps(job) or set()):
            return
        time.sleep(0.5)
    raise AssertionError(f"step {step} of job {job} never ran")


@pytest.mark.slurm
def test_a_second_step_of_the_same_allocation_does_not_take_a_live_claim(tmp_path: Path) -> None:
    job = running_job("srun -n1 sleep 60")
    try:
        wait_step(job, "0")
        first = Claim(tmp_path, Holder(job, "n1", 4242, time.time(), step="0")).acquire()
        with pytest.raises(CheckpointError, match=rf"claimed by job {job} step 0 on n1 .* which is still running"):
            Claim(tmp_path, Holder(job, "n1", 4343, time.time(), step="1")).acquire()
        # The same step started again by a requeue (a higher restart count) takes it back.
        again = Claim(tmp_path, Holder(job, "n2", 4444, time.time(), step="0", restarts=1)).acquire()
        assert read(tmp_path) == again.holder
        with pytest.raises(CheckpointError, match="no longer this run's"):
            first.check()
        again.check()
    finally:
        slurm.scancel(job)


@pytest.mark.slurm
def test_a_step_that_ended_leaves_its_claim_to_the_next_step(tmp_path: Path) -> None:
    job = running_job("srun -n1 true; srun -n1 sleep 60")
    try:
        wait_step(job, "1")
        Claim(tmp_path, Holder(job, "n1", 4242, time.time(), step="0")).acquire()  # step 0's, left behind
        mine = Claim(tmp_path, Holder(job, "n1", 4343, time.time(), step="1")).acquire()
        assert mine.took_over is not None and mine.took_over.step == "0"
    finally:
        slurm.scancel(job)


@pytest.mark.slurm
def test_silence_is_not_death(tmp_path: Path) -> None:
    require_slurm()
    # A job id Slurm has never heard of (another cluster's, or hidden by PrivateData): squeue
    # answers nothing and sacct has no record. Before: taken over as stale.
    Claim(tmp_path, Holder("987654", "n9", 1, time.time())).acquire()
    with pytest.raises(CheckpointError, match=r"claimed by job 987654 on n9 .* cannot be checked from here: Slurm "
                                              r"lists no such job and has no record of its end"):
        Claim(tmp_path, here("local-1")).acquire()
    assert read(tmp_path) is not None and read(tmp_path).job_id == "987654"  # type: ignore[union-attr]


def test_a_claim_file_that_cannot_be_read_is_an_error_not_a_free_directory(tmp_path: Path) -> None:
    (tmp_path / ".claim").mkdir()  # reads fail with an OSError (root reads any file despite its mode)
    with pytest.raises(CheckpointError, match=r"cannot read the checkpoint claim .*\.claim \(IsADirectoryError"):
        Claim(tmp_path, here("local-1")).acquire()


def _take_slowly(directory: str, job: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """One taker whose liveness check of the stale holder takes half a second."""
    real = claim_mod.verdict

    def slow(current: Holder, me: Holder) -> tuple[bool, str]:
        if current.job_id == "local-stale":
            time.sleep(0.5)
            return True, "stale"
        return real(current, me)

    claim_mod.verdict = slow  # type: ignore[assignment]
    try:
        Claim(directory, here(job)).acquire()
        out.put((job, "won"))
        time.sleep(3)  # holds it while the other decides
    except CheckpointError as exc:
        out.put((job, str(exc)))


def test_two_takers_of_one_stale_claim_cannot_both_win(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    Claim(tmp_path, here("local-stale", pid=dead.pid)).acquire()
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    takers = [ctx.Process(target=_take_slowly, args=(str(tmp_path), f"local-{i}", out)) for i in (1, 2)]
    for p in takers:
        p.start()
    results = dict(out.get(timeout=30) for _ in takers)
    for p in takers:
        p.join(timeout=30)
    assert sorted(v == "won" for v in results.values()) == [False, True], results
    loser = next(v for v in results.values() if v != "won")
    assert "which is still running" in loser, loser


def test_a_holder_whose_claim_was_taken_commits_nothing_more(tmp_path: Path) -> None:
    import numpy as np

    from hpcdist.store.checkpoint.manager import CheckpointStore

    store = CheckpointStore(tmp_path, keep_last=3)
    store.claim(here("local-7", restarts=0))
    store.save(1, {"w": np.zeros(4)})
    Claim(tmp_path, here("local-7", restarts=1)).acquire()  # a later start of the job took it back
    with pytest.raises(CheckpointError, match=r"no longer this run's .* held by job local-7 .*restart 1"):
        store.save(2, {"w": np.ones(4)})
    assert store.steps() == [1] and store.latest() is not None and store.latest().name.endswith("1.h5")  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["latest", "step_00000001.h5"]

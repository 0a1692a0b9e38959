"""Requeues of train_gpt on the real local Slurm cluster (2 nodes x 1 task), beyond the site's
preemption signal: Slurm's own preemption (SIGTERM, KillWait seconds before SIGKILL, and Slurm
requeues the job itself), a user's `scancel` (SIGTERM too, but the job must stay cancelled), and
a run whose `params.checkpoint.resume: false` applies to its first start only, with the requeue
count taken from Slurm's own (SLURM_RESTART_COUNT) so no setting can requeue a job forever."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpcdist.api import Context
from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.errors import JobError
from hpcdist.runtime import requeue as rq
from hpcdist.store.results import read_attrs
from tests.support import train as fx
from tests.support.cli import require_slurm, result_path
from tests.support.rankctx import rank_context
from tests.support.train import (
    STEPS,
    TWO_NODES,
    Background,
    assert_completed_after_one_requeue,
    ckpt_dir,
    differing,
    final_checkpoint,
    preempted_slurm_run,
    queue_state,
    rank_log,
    slurm_job,
    stopped_at,
    train_args,
    wait_for,
)

train_root, tokens, reference = fx.train_root, fx.tokens, fx.reference
# ---------------------------------------------------------------- the bound, for any code


@pytest.fixture(autouse=True)
def stop_flag_reset() -> Iterator[None]:
    """The stop flag is the process's: clear it, and give the test process its handlers back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    yield
    rq._received.clear()
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def api_context(tmp_path: Path, restarts: int, monkeypatch: pytest.MonkeyPatch) -> Context:
    """One rank of a job that Slurm restarted `restarts` times, with 3 time-outs allowed, at the
    end of its 60 minutes (a stop now is a time-out)."""
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    monkeypatch.setenv(LAUNCH_TIME_VAR, str(time.time() - 60 * 60))
    return rank_context(tmp_path, job_id="77", keep_last=2, requeue=lambda: "",
                        site_sets=["preemption.max_requeues=3", "preemption.signal=USR2"])


def test_slurms_restart_count_bounds_a_job_that_lost_its_checkpoints(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that starts afresh on every requeue (resume: false, start_fresh, a script that never
    loads) still stops after max_requeues time-outs: Slurm's count is the floor, and a restart
    that is not on record counts as a time-out."""
    assert rq.restart_count({"SLURM_RESTART_COUNT": "3"}) == 3 and rq.restart_count({}) == 0
    ctx = api_context(tmp_path, restarts=3, monkeypatch=monkeypatch)
    assert ctx.requeue_count == rq.Requeues(3, 3)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert ctx.should_stop() and (ctx.stop_signal, ctx.stop_kind) == ("USR2", "timeout")
    with pytest.raises(JobError, match=r"job timed out 4 time\(s\), more than preemption.max_requeues=3: not requeued"):
        ctx.requeue()


def test_a_checkpoints_record_tells_preemptions_from_time_outs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count a checkpoint of the same job recorded wins over the floor: 3 preemptions and a
    time-out may requeue again; the record of another job (a resubmission) is not this job's."""
    ctx = api_context(tmp_path, restarts=3, monkeypatch=monkeypatch)
    ctx.restore_requeues(rq.Requeues(3, 0), job_id="76")
    assert ctx.requeue_count == rq.Requeues(3, 3)
    ctx.restore_requeues(rq.Requeues(3, 0), job_id="77")
    assert ctx.requeue_count == rq.Requeues(3, 0)
    os.kill(os.getpid(), signal.SIGTERM)
    assert ctx.should_stop() and ctx.stop_signal == "TERM"
    ctx.checkpoints.save(5, {"w": torch.zeros(2)})
    assert ctx.requeue_refusal() == ""
    with pytest.raises(rq.Requeued):
        ctx.requeue()
    assert ctx.requeue_count == rq.Requeues(4, 1)
    rq._received.clear()
    # the requeued job: its count comes back with the checkpoint
    again = api_context(tmp_path, restarts=4, monkeypatch=monkeypatch)
    loaded = again.checkpoints.load_latest()
    assert loaded is not None and again.requeue_count == rq.Requeues(4, 1)
    again.close()


# ---------------------------------------------------------------- on the cluster


@pytest.mark.slurm
def test_slurm_preemption_by_sigterm_checkpoints_and_resumes_bit_for_bit(train_root: Path, tokens: Path,
                                                                         reference: Path) -> None:
    """Slurm's PreemptMode=REQUEUE (here `scontrol requeue`) sends SIGTERM, not the site's USR2:
    the ranks checkpoint within KillWait (5 s here), leave the requeue to Slurm, and resume."""
    require_slurm()
    root = train_root / "slurm-sigterm"
    jid, result = preempted_slurm_run(root, tokens, "requeue")
    assert_completed_after_one_requeue(jid, result, ranks=2)
    log = rank_log(root, 0)
    stopped = stopped_at(log, "TERM")
    assert 20 <= stopped < STEPS
    assert f"Slurm is requeueing job {jid} itself" in log
    assert f"resumed from {ckpt_dir(root) / f'step_{stopped:08d}.h5'}: step {stopped}" in log
    assert differing(final_checkpoint(root), reference) == []
    attrs = read_attrs(result_path(result.out))
    assert attrs["requeues"] == 1 and attrs["final_step"] == STEPS


@pytest.mark.slurm
def test_slurm_scancel_checkpoints_and_is_not_requeued(train_root: Path, tokens: Path) -> None:
    """A user's `scancel` also sends SIGTERM: the ranks checkpoint, but the job stays cancelled
    (`scontrol requeue` would revive a cancelled job that is still completing)."""
    require_slurm()
    root = train_root / "slurm-scancel"
    job = Background(train_args(root, tokens, *TWO_NODES, site="local-slurm"))
    try:
        wait_for(lambda: "step 20/400" in rank_log(root), 120, "step 20 in rank 0's log")
        jid = slurm_job(root)
        subprocess.run(["scancel", jid], check=True)
        wait_for(lambda: queue_state(jid) == "", 60, "the cancelled job to leave the queue")
        job.finish(timeout=60)
    finally:
        job.kill()
    history = subprocess.run(["sacct", "-j", jid, "-X", "-n", "-P", "--duplicates", "-o", "State"],
                             capture_output=True, text=True).stdout.splitlines()
    assert len(history) == 1 and history[0].startswith("CANCELLED"), history  # never REQUEUED
    log = rank_log(root, 0)
    stopped = stopped_at(log, "TERM")
    assert f"job {jid} is ending in Slurm (" in log and "not requeued" in log
    assert (ckpt_dir(root) / f"step_{stopped:08d}.h5").is_file()


@pytest.mark.slurm
def test_slurm_resume_false_applies_to_the_first_start_only(train_root: Path, tokens: Path, reference: Path) -> None:
    """With `params.checkpoint.resume: false` a requeued job resumed at step 0 with its count at 0,
    so it could be requeued forever; its requeue resumes, counted from Slurm's restart count."""
    require_slurm()
    root = train_root / "slurm-resume-false"
    jid, result = preempted_slurm_run(root, tokens, "USR2", "--set", "params.checkpoint.resume=false")
    assert_completed_after_one_requeue(jid, result, ranks=2)
    log = rank_log(root, 0)
    stopped = stopped_at(log, "USR2")
    assert log.count("starting fresh") == 1
    assert f"resumed from {ckpt_dir(root) / f'step_{stopped:08d}.h5'}: step {stopped}" in log
    assert differing(final_checkpoint(root), reference) == []
    attrs = read_attrs(result_path(result.out))
    assert attrs["requeues"] == 1 and attrs["final_step"] == STEPS

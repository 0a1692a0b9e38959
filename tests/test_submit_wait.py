"""`hpcdist submit --wait` takes the job's end and final state from Slurm: a job Slurm calls
FAILED is never a success, and a job that dies before submitit's runner writes anything still
ends the wait, with the first real error line of each rank's log."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from hpcdist.login.postmortem import StepRecord, ending, task_ends
from hpcdist.login.postmortem import first_error_line as _first_error_line
from hpcdist.scheduler.states import JobState
from tests.support.cli import REPO, job_id, run_cli, sacct_state, storage_sets
from tests.support.train import Background, wait_for

RANKS = REPO / "tests" / "scripts" / "ranks.py"


@pytest.mark.parametrize(("text", "state"), [
    ("COMPLETED", JobState.COMPLETED), ("CANCELLED by 0", JobState.CANCELLED), ("FAILED", JobState.FAILED),
    ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY), ("NODE_FAIL", JobState.NODE_FAIL), ("TIMEOUT", JobState.TIMEOUT),
    ("RUNNING", JobState.RUNNING), ("PENDING", JobState.PENDING), ("REQUEUED", JobState.REQUEUED),
    ("CG", JobState.COMPLETING), ("PD", JobState.PENDING), ("CD", JobState.COMPLETED), ("F", JobState.FAILED),
    ("", JobState.UNKNOWN), ("SOMETHING_NEW", JobState.UNKNOWN),
])
def test_slurm_states_map_to_one_enum(text: str, state: JobState) -> None:
    assert JobState.from_slurm(text) is state


def test_only_ended_states_are_final() -> None:
    assert {s for s in JobState if s.final} == {
        JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED, JobState.OUT_OF_MEMORY,
        JobState.NODE_FAIL, JobState.PREEMPTED, JobState.BOOT_FAIL, JobState.DEADLINE,
    }


def test_first_real_error_line_of_a_log() -> None:
    log = ("INFO starting\nslurmstepd: error: execve(): /nope/python: No such file or directory\n"
           "srun: error: n1: task 0: Exited with exit code 2\n")
    assert _first_error_line(log, first=True) == "slurmstepd: error: execve(): /nope/python: No such file or directory"
    tb = "Traceback (most recent call last):\n  x\nhpcdist.errors.BootstrapError: rendezvous: rank 1 missing\n"
    assert _first_error_line(tb, first=True) == "BootstrapError: rendezvous: rank 1 missing"


def test_job_slurm_calls_failed_is_not_a_success(slurm_storage: Path) -> None:
    # every rank succeeds, then the batch script itself exits 3: Slurm says FAILED
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait", "--set", "site.launcher.args=[]",
        "--set", "site.setup=[\"trap 'exit 3' EXIT\"]", *storage_sets(slurm_storage),
    )
    jid = job_id(result.out)
    assert result.code == 1, result.text
    assert f"job {jid} finished: FAILED; 2/2 ranks succeeded" in result.out
    assert sacct_state(jid) == "FAILED"


def test_wait_ends_when_the_job_dies_before_any_result(slurm_storage: Path) -> None:
    t0 = time.monotonic()
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait", "--set", "site.launcher.args=[]",
        "--set", "site.python=/nonexistent/bin/python", *storage_sets(slurm_storage), timeout=120,
    )
    took = time.monotonic() - t0
    jid = job_id(result.out)
    assert result.code == 1, result.text
    assert f"job {jid} finished: FAILED; 0/2 ranks succeeded" in result.out
    assert "rank 1: FAILED no result; slurmstepd-n1: error: execve(): /nonexistent/bin/python" in result.out, result.out
    assert took < 60, took
    assert sacct_state(jid) == "FAILED"


BATCH_LOG = """[rank0]: hpcdist.errors.JobError: rank 0 on n1: ranks.py raised RuntimeError: Connection closed by peer
srun: error: n2: task 1: Killed
srun: error: n1: task 0: Exited with exit code 1
srun: Force Terminated StepId=707.0
"""


def test_the_first_rank_to_end_is_read_from_srun_lines() -> None:
    end = ending(BATCH_LOG, [StepRecord("707", "FAILED", "9:0", "1:0", "n[1-2]"),
                             StepRecord("707.0", "FAILED", "1:0", "", "n[1-2]")])
    assert [(t.rank, t.host, t.how) for t in task_ends(BATCH_LOG)] == [
        (1, "n2", "killed by SIGKILL"), (0, "n1", "exited with code 1")]
    assert end.headline() == "rank 1 on n2 went first: killed by SIGKILL"
    assert end.after(0) == "after rank 1 on n2 was killed by SIGKILL" and end.after(1) == ""


@pytest.mark.parametrize(("log", "records", "cause"), [
    ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-22T11:00:00 ***\n",
     [StepRecord("9", "CANCELLED by 0", "0:0", "0:0", "n[1-2]")],
     "cancelled (by uid 0) [sacct: 9 CANCELLED by 0, exit 0:0]; cancelled on n1"),
    ("slurmstepd: error: *** STEP 9.0 ON n1 CANCELLED AT 2026-11-22T11:00:00 DUE TO NODE FAILURE ***\n",
     [StepRecord("9", "NODE_FAIL", "0:0", "0:0", "n2")],
     "node failure on n2 [sacct: 9 NODE_FAIL, exit 0:0]; cancelled on n1 due to node failure"),
    ("srun: error: Detected 1 oom_kill event in StepId=9.0. Some of the step tasks have been OOM Killed.\n",
     [StepRecord("9", "OUT_OF_MEMORY", "0:125", "0:0", "n1"), StepRecord("9.0", "OUT_OF_MEMORY", "0:125", "", "n1")],
     "out of memory on n1 [sacct: 9 OUT_OF_MEMORY, exit 0:125]; out of memory (the kernel's OOM killer ended a task)"),
    ("", [StepRecord("9", "FAILED", "0:0", "0:0", "n1"), StepRecord("9.0", "FAILED", "0:9", "", "n1")],
     "step 9.0 killed by SIGKILL [sacct: FAILED, exit 0:9]"),
])
def test_slurm_says_what_ended_the_job(log: str, records: list[StepRecord], cause: str) -> None:
    assert ending(log, records).cause == cause


def test_a_rank_killed_by_sigkill_is_named_with_its_host(slurm_storage: Path) -> None:
    """Rank 1 SIGKILLs itself while rank 0 waits in an all_reduce: the summary says rank 1 on n2
    was killed by SIGKILL and went first (its log ended on an INFO line), and rank 0's gloo
    error names the peer behind the closed connection."""
    result = run_cli(
        "submit", "--site", "local-slurm", "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1",
        "--set", "sbatch.nodelist=n1,n2",  # the nodes the summary names (the cluster has more)
        "--set", "timeout_s=60", *storage_sets(slurm_storage), "--wait", "--", str(RANKS), "m", "kill", "1",
        timeout=240,
    )
    jid = job_id(result.out)
    assert result.code == 1, result.text
    assert f"job {jid} finished: FAILED; 0/2 ranks succeeded" in result.out, result.out
    assert "  cause: rank 1 on n2 went first: killed by SIGKILL" in result.out, result.out
    assert "  rank 1: FAILED killed by SIGKILL on n2 (the first rank to end); no result" in result.out, result.out
    rank0 = next(line for line in result.out.splitlines() if line.startswith("  rank 0: FAILED"))
    assert "Connection closed by peer" in rank0 and "the peer 10.251.0.12 is n2 (rank 1)" in rank0, rank0
    assert rank0.endswith("(after rank 1 on n2 was killed by SIGKILL)"), rank0


def test_a_cancelled_job_is_said_to_be_cancelled(slurm_storage: Path) -> None:
    """scancel while both ranks run: the summary says Slurm cancelled it (sacct), not the last
    line each rank's log ended with."""
    job = Background(["submit", "--site", "local-slurm", "--set", "resources.nodes=2", "--set",
                      "resources.tasks_per_node=1", *storage_sets(slurm_storage), "--wait", "--", str(RANKS), "m",
                      "sleep", "120"])
    try:
        logs = slurm_storage / "logs" / "ranks"
        wait_for(lambda: sum("sleeping" in p.read_text() for p in logs.glob("*/*_log.out")) == 2, 180,
                 "both ranks sleeping")
        jid = next(p.name for p in logs.iterdir() if p.name.isdigit())
        subprocess.run(["scancel", jid], check=True, timeout=30)
        result = job.finish(timeout=120)
    finally:
        job.kill()
    assert result.code == 1, result.text
    assert f"job {jid} finished: CANCELLED; 0/2 ranks succeeded" in result.out, result.out
    assert re.search(rf"  cause: .*cancelled \(by uid \d+\) \[sacct: {jid} CANCELLED by \d+", result.out), result.out
    for rank in (0, 1):
        line = next(ln for ln in result.out.splitlines() if ln.startswith(f"  rank {rank}: FAILED"))
        assert "cancelled" in line or "SIGTERM" in line or "SIGKILL" in line, line

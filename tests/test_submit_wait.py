"""`hpcdist submit --wait` takes the job's end and final state from Slurm: a job Slurm calls
FAILED is never a success, and a job that dies before submitit's runner writes anything still
ends the wait, with the first real error line of each rank's log."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpcdist.submit import JobState, _first_error_line
from tests.conftest import run_cli, storage_sets
from tests.test_slurm_spine import job_id, sacct_state


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

"""train_gpt on the real local Slurm cluster (2 nodes): `scancel --signal=USR2` mid-run, the job
checkpoints, requeues itself through submitit (`scontrol requeue`), comes back, resumes, and ends
with parameters bit-identical to the uninterrupted run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.conftest_train")

from hpcdist.results import read_attrs  # noqa: E402
from tests.conftest import slurm_up  # noqa: E402
from tests.conftest_train import (  # noqa: E402
    STEPS,
    Background,
    differing,
    final_checkpoint,
    rank_log,
    train_args,
    wait_for,
)
from tests.test_local_site import result_path  # noqa: E402

pytest_plugins = ["tests.conftest_train"]

pytestmark = pytest.mark.slurm


def squeue(jid: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T %r"], capture_output=True, text=True).stdout.strip()


def test_preempted_job_requeues_and_resumes_bit_for_bit(train_root: Path, tokens: Path, reference: Path) -> None:
    if not slurm_up():
        pytest.skip("the local Slurm cluster is not up (make cluster-up)")
    root = train_root / "slurm-preempt"
    job = Background(train_args(root, tokens, "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1",
                                site="local-slurm"))
    try:
        wait_for(lambda: "step 20/400" in rank_log(root), 120, "step 20 in rank 0's log")
        jid = next(p.name for p in (root / "logs" / "train_gpt").iterdir() if p.name.isdigit())
        subprocess.run(["scancel", "--signal=USR2", jid], check=True)
        # Slurm holds a requeued job for ~2 minutes (BeginTime); release it so the test stays short.
        wait_for(lambda: squeue(jid).startswith("PENDING"), 60, "the job to be requeued (PENDING)")
        subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], check=True)
        result = job.finish(timeout=180)
    finally:
        job.kill()
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in result.out
    history = subprocess.run(["sacct", "-j", jid, "-X", "-n", "-P", "--duplicates", "-o", "State"],
                             capture_output=True, text=True).stdout.split()
    assert history == ["REQUEUED", "COMPLETED"], history
    log = rank_log(root, 0)
    stopped = int(re.search(r"USR2 signal received: checkpointing at step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert 20 <= stopped < STEPS
    assert "requeueing job" in log and "(slurm)" in log
    assert f"resumed from {root / 'checkpoints' / 'train_gpt' / f'step_{stopped:08d}.h5'}: step {stopped}" in log
    assert differing(final_checkpoint(root), reference) == []
    attrs = read_attrs(result_path(result.out))
    assert attrs["requeues"] == 1 and attrs["final_step"] == STEPS
    assert attrs["num_nodes"] == 2 and attrs["hosts"] == ["n1", "n2"]

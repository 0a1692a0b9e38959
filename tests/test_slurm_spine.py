"""The spine on the real local Slurm cluster: sbatch + srun across two nodes, PMIx + mpi4py,
`hpcdist status`, and a rank that never joins."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import h5py

from hpcdist.store.results import read_attrs, read_table
from tests.support.cli import job_id, result_path, run_cli, sacct_state, storage_sets


def test_smoke_two_nodes_two_tasks(slurm_storage: Path) -> None:
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait",
        "--set", "resources.nodes=2", "--set", "sbatch.nodelist=n1,n2", *storage_sets(slurm_storage),
    )
    assert result.code == 0, result.text
    jid = job_id(result.out)
    assert f"job {jid} finished: COMPLETED; 4/4 ranks succeeded" in result.out
    assert sacct_state(jid) == "COMPLETED"
    attrs = read_attrs(result_path(result.out))
    assert attrs["world_size"] == 4 and attrs["num_nodes"] == 2 and attrs["job_id"] == jid
    assert attrs["hosts"] == ["n1", "n1", "n2", "n2"]
    with h5py.File(result_path(result.out)) as f:
        assert f.attrs["sum"] == 6.0
        assert "SLURM_JOB_ID" in f["env"].attrs
        boot = read_table(f["bootstrap"])
    assert (boot["launch_to_ready_s"] > 0).all()
    # the submitted script is the rendered one
    rendered = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "resources.nodes=2",
                       "--set", "sbatch.nodelist=n1,n2", *storage_sets(slurm_storage))
    submitted = (slurm_storage / "logs" / "smoke" / jid / f"{jid}_submission.sh").read_text()
    assert submitted == rendered.out
    status = run_cli("status", jid)
    assert status.code == 0 and "COMPLETED" in status.out and "n[1-2]" in status.out


def test_smoke_under_srun_pmix_with_mpi4py(slurm_storage: Path) -> None:
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait",
        "--set", "resources.nodes=2", "--set", "params.mpi=true", *storage_sets(slurm_storage),
    )
    assert result.code == 0, result.text
    assert result.out.count('"mpi_sum": 6') == 4
    attrs = read_attrs(result_path(result.out))
    assert attrs["version_mpi"].startswith("Open MPI")
    log = next((slurm_storage / "logs" / "smoke").glob("*/*_0_log.err")).read_text()
    assert "via pmix" in log and "via mpi" in log  # PMIx launch, endpoint published over MPI


def test_rank_that_exits_early_is_named(slurm_storage: Path) -> None:
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait",
        "--set", "resources.nodes=2", "--set", "timeout_s=10", "--set", "env.HPCDIST_FAULT_EXIT_RANK=3",
        *storage_sets(slurm_storage),
    )
    assert result.code == 1
    jid = job_id(result.out)
    for rank in (0, 1, 2):  # every waiting rank names rank 3
        assert re.search(rf"rank {rank}: FAILED BootstrapError: rendezvous: rank\(s\) 3 of 4 (did not join within 10 s|"
                         rf"had not joined when rank 0's store closed)", result.out), result.out
    assert "did not join within 10 s" in result.out
    # failed by hpcdist's own timeout, long before Slurm's 5-minute limit
    assert sacct_state(jid) == "FAILED"


def test_status_of_unknown_job() -> None:
    result = run_cli("status", "abc")
    assert result.code == 2 and "is not a Slurm job id" in result.err


def test_gpu_request_on_a_node_without_usable_gpu(slurm_storage: Path) -> None:
    """The emulated GPUs are GRES only: Slurm sets CUDA_VISIBLE_DEVICES, torch sees no GPU."""
    sets = ["resources.partition=gpu", "resources.gpus_per_node=4", "resources.tasks_per_node=4", "timeout_s=10"]
    result = run_cli("submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait",
                     *[a for s in sets for a in ("--set", s)], *storage_sets(slurm_storage))
    assert result.code == 1
    assert "rank 0: FAILED BootstrapError: job asks for GPUs (gpus_per_node=4, backend=auto) but on n1 " \
           "CUDA_VISIBLE_DEVICES='0,1,2,3' is set but torch sees no usable GPU" in result.out


def test_env_shows_what_the_bootstrap_sees_on_a_node(slurm_storage: Path) -> None:
    import os
    import sys

    from tests.support.cli import REPO

    proc = subprocess.run(
        ["srun", "-N2", "-w", "n1,n2", "--ntasks-per-node=1", sys.executable, "-m", "hpcdist.cli", "env"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("launcher: slurm") == 2
    assert "rank 0/2 (local 0/1, node 0/2) on n1 via slurm" in proc.stdout
    assert "rank 1/2 (local 0/1, node 1/2) on n2 via slurm" in proc.stdout
    assert "hosts: n1, n2" in proc.stdout and "torch: 2." in proc.stdout

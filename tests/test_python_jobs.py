"""The `python` job kind as a user submits it: `hpcdist submit --site SITE -- script.py ARG...`.

An unchanged torchrun-style DDP script runs on the local site and on the real cluster (2 nodes x
2 tasks) under srun, srun --mpi=pmix, mpirun and torchrun; a rank that exits 3 or raises fails the job
naming the rank, its host and the code or exception; the job runs the code snapshot taken at
submit (an edit made after submitting changes nothing, git-ignored files are left out); each kind
of bad input is one clear error before anything is queued.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import REPO, run_cli, storage_sets
from tests.support.train import Background, wait_for

PLAIN = REPO / "examples" / "ddp_plain.py"
RANKS = REPO / "tests" / "scripts" / "ranks.py"
MPIRUN_AS_ROOT = ["--set", "site.env.OMPI_ALLOW_RUN_AS_ROOT=1", "--set", "site.env.OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"]


def rank_logs(root: Path, name: str) -> str:
    """Every rank's stdout of the (one) job named `name` under `root`, rank order."""
    folder = next(p for p in (root / "logs" / name).iterdir() if p.name.isdigit())
    return "".join(p.read_text() for p in sorted(folder.glob("*_log.out")))


def test_plain_ddp_script_runs_unchanged_on_the_local_site(local_storage: list[str], tmp_path: Path) -> None:
    result = run_cli("submit", "--site", "local", "--set", "resources.tasks_per_node=2", *local_storage,
                     "--wait", "--", str(PLAIN), "--steps", "20")
    assert result.code == 0, result.text
    assert "submitted job" in result.out and "(ddp_plain, kind python)" in result.out
    assert "2/2 ranks succeeded" in result.out and '"exit_code": 0' in result.out
    logs = rank_logs(tmp_path / "out", "ddp_plain")
    assert "rank 0/2 (local 0)" in logs and "rank 1/2 (local 1)" in logs
    assert "done: 20 steps on 2 ranks" in logs


@pytest.mark.parametrize(("fault", "expected"), [
    (["exit", "1", "3"], r"rank 1: FAILED JobError: rank 1 on \S+: ranks\.py exited with code 3"),
    (["raise", "1"], r"rank 1: FAILED JobError: rank 1 on \S+: ranks\.py raised ValueError: bad value on rank 1"),
])
def test_a_failing_rank_is_named_with_its_host_and_code(local_storage: list[str], fault: list[str],
                                                        expected: str) -> None:
    result = run_cli("submit", "--site", "local", "--set", "resources.tasks_per_node=2", "--set", "timeout_s=20",
                     *local_storage, "--wait", "--", str(RANKS), "m", *fault)
    assert result.code == 1, result.text
    assert re.search(expected, result.out), result.out
    assert "1/2 ranks succeeded" in result.out or "0/2 ranks succeeded" in result.out


def test_the_job_runs_the_snapshot_taken_at_submit(tmp_path: Path) -> None:
    code = tmp_path / "code"
    (code / "data").mkdir(parents=True)
    shutil.copy(RANKS, code / "ranks.py")
    (code / "helper.py").write_text("X = 1\n")
    (code / "data" / "big.bin").write_bytes(b"\0" * 2_000_000)
    (code / ".gitignore").write_text("data/\n")
    subprocess.run(["git", "init", "-q", str(code)], check=True)
    root = tmp_path / "out"
    job = Background(["submit", "--site", "local", "--set", "resources.tasks_per_node=2", *storage_sets(root),
                      "--set", "params.snapshot_max_mb=1", "--wait", "--", str(code / "ranks.py"), "before"])
    try:
        wait_for(lambda: any((root / "logs" / "ranks").glob("code-*/ranks.py")), 60, "the code snapshot")
        time.sleep(0.5)
        (code / "ranks.py").write_text("raise SystemExit('the edited script ran')\n")
        result = job.finish(timeout=120)
    finally:
        job.kill()
    assert result.code == 0, result.text
    logs = rank_logs(root, "ranks")
    assert "marker before RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 NODE_RANK=0" in logs
    assert "sum 1" in logs and "edited" not in logs
    snap = next((root / "logs" / "ranks").glob("code-*"))
    assert sorted(p.name for p in snap.iterdir()) == [".gitignore", "helper.py", "ranks.py"]  # data/ left out


@pytest.mark.parametrize(("argv", "expected"), [
    (["--", "no/such/train.py"],
     r"params\.script: 'no/such/train\.py' does not exist; .*read from the current folder"),
    (["--", "-m", "no_such_module_xyz"], r"params\.module: 'no_such_module_xyz' .* an importable module"),
    (["--set", "params.args=[1, 2]", "--", "SCRIPT"], r"params\.args\.0: Input should be a valid string"),
    (["--set", "params.snapshot_max_mb=0.0001", "--", "SCRIPT"],
     r"params\.snapshot: '.*/tests/scripts' .* holds [\d.]+ MB in \d+ files"),
    (["--set", "params.function=mypkg.mod:VALUE", "--set", "params.script=null", "--", "SCRIPT"],
     r"params\.function: 'mypkg\.mod:VALUE' .* a callable, but VALUE is a int"),
])
def test_bad_input_is_one_clear_error_before_anything_is_queued(tmp_path: Path, argv: list[str],
                                                                expected: str) -> None:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "mod.py").write_text("VALUE = 3\n")
    root = tmp_path / "out"
    argv = [str(RANKS) if a == "SCRIPT" else a for a in argv]
    result = run_cli("submit", "--site", "local", *storage_sets(root), "--wait", *argv, cwd=tmp_path)
    assert result.code == 2, result.text
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcdist: error: "), result.err
    assert re.search(expected, lines[0]), lines[0]
    assert not (root / "logs").exists()  # nothing was snapshotted or queued


def test_under_torchrun_the_script_keeps_torchruns_own_variables() -> None:
    from hpcdist.kinds.python_run import script_env
    from hpcdist.runtime.rankinfo import RankInfo

    worker = {"TORCHELASTIC_RUN_ID": "myrun", "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "3", "WORLD_SIZE": "4",
              "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
              "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default", "MASTER_ADDR": "10.0.0.1",
              "MASTER_PORT": "36315", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    info = RankInfo.from_env(worker, hostname="n2")
    assert script_env(info, "10.0.0.1", 36315, "local", worker) == {  # what torchrun leaves out
        "NODE_RANK": "1", "HPCDIST_LOCAL_RANK": "1"}
    # under srun every variable comes from hpcdist, the run id from the job
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77"}
    env = script_env(RankInfo.from_env(slurm, hostname="n2"), "10.0.0.1", 4000, "77", slurm)
    assert {k: env[k] for k in ("RANK", "GROUP_RANK", "NODE_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID")} == {
        "RANK": "3", "GROUP_RANK": "1", "NODE_RANK": "1", "MASTER_PORT": "4000", "TORCHELASTIC_RUN_ID": "77"}
    assert env.keys() >= worker.keys()


def test_render_shows_the_command_form() -> None:
    result = run_cli("render", "--site", "local-slurm", "--set", "resources.nodes=2", "--", str(PLAIN), "--steps", "5")
    assert result.code == 0, result.err
    assert f"hpcdist submit --site local-slurm --set resources.nodes=2 -- {PLAIN} --steps 5" in result.out
    assert "#SBATCH --job-name=ddp_plain" in result.out


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", [
    ["--set", "site.launcher.args=[]"],  # plain srun
    [],  # the site's srun --mpi=pmix
    ["--set", "site.launcher.kind=mpirun", "--set", "site.launcher.args=[]", *MPIRUN_AS_ROOT],
    ["--set", "site.launcher.kind=torchrun", "--set", "site.launcher.args=[]"],  # one agent per node
], ids=["srun", "srun-pmix", "mpirun", "torchrun"])
def test_plain_ddp_script_on_two_nodes(slurm_storage: Path, launcher: list[str]) -> None:
    result = run_cli("submit", "--site", "local-slurm", "--set", "resources.nodes=2", "--set", "sbatch.nodelist=n1,n2",
                     "--set", "resources.tasks_per_node=2", *launcher, *storage_sets(slurm_storage),
                     "--wait", "--", str(PLAIN), "--steps", "20", timeout=240)
    assert result.code == 0, result.text
    assert re.search(r"finished: COMPLETED; 4/4 ranks succeeded", result.out), result.out
    assert re.search(r'rank 3: ok \{"host": "n2"', result.out), result.out
    logs = rank_logs(slurm_storage, "ddp_plain")
    assert "done: 20 steps on 4 ranks" in logs and "rank 3/4 (local 1)" in logs


@pytest.mark.slurm
def test_a_rank_exiting_3_on_the_cluster_names_rank_host_and_code(slurm_storage: Path) -> None:
    result = run_cli("submit", "--site", "local-slurm", "--set", "resources.nodes=2", "--set", "timeout_s=20",
                     *storage_sets(slurm_storage), "--wait", "--", str(RANKS), "m", "exit", "1", "3", timeout=240)
    assert result.code == 1, result.text
    assert "rank 1: FAILED JobError: rank 1 on n2: ranks.py exited with code 3" in result.out, result.out

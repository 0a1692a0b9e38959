"""Jobs in containers on the real cluster: every rank in the Charliecloud image `make image` builds
(cluster/image.sh), the launcher outside, 2 nodes. The smoke job under srun with PMIx and MPI
across the boundary, under torchrun and under mpirun; a user's script on ``hpcdist.init()``;
``train_gpt`` preempted with USR2, requeued by the batch step outside the image and resumed bit for
bit; and a member of the shared site (alice, not root) running the smoke job in it."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from hpcdist.store.results import read_attrs
from tests.support import train as fx
from tests.support.cli import REPO, job_id, missing, result_path, run_cli, storage_sets
from tests.support.members import GROUP_ROOT, as_user, require_members
from tests.support.train import STEPS, ckpt_dir, differing, final_checkpoint, preempted_slurm_run, rank_log, stopped_at

train_root, tokens, reference = fx.train_root, fx.tokens, fx.reference

IMAGE = Path(os.environ.get("HPCDIST_IMAGE", "/var/tmp/hpcdist-images/bookworm"))  # the Makefile's IMAGE
IN_IMAGE = ["--set", f"container.image={IMAGE}"]  # the site's default runtime: Charliecloud
MPIRUN_AS_ROOT = ["--set", "env.OMPI_ALLOW_RUN_AS_ROOT=1", "--set", "env.OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"]
TWO_BY_TWO = ["--set", "resources.nodes=2", "--set", "resources.tasks_per_node=2", "--set", "sbatch.nodelist=n1,n2"]


@pytest.fixture(autouse=True)
def image() -> Path:
    if shutil.which("ch-run") is None:
        missing("ch-run is missing: run `make system-deps` (charliecloud-runtime)")
    if not (IMAGE / "usr" / "bin" / "python3").exists():
        missing(f"no container image at {IMAGE}: run `make image`")
    return IMAGE


def launch_line(root: Path, name: str, jid: str) -> str:
    script = (root / "logs" / name / jid / f"{jid}_submission.sh").read_text()
    return next(ln for ln in script.splitlines() if ln.startswith(("srun --unbuffered", "mpirun ")))


@pytest.mark.parametrize("launcher", [
    [],  # the site's srun --mpi=pmix, with MPI inside
    ["--set", "site.launcher.kind=mpirun", "--set", "site.launcher.args=[]", *MPIRUN_AS_ROOT],
    ["--set", "site.launcher.kind=torchrun", "--set", "site.launcher.args=[]"],
], ids=["srun-pmix", "mpirun", "torchrun"])
@pytest.mark.slurm
def test_smoke_in_the_image_on_two_nodes(slurm_storage: Path, launcher: list[str]) -> None:
    mpi = "torchrun" not in str(launcher)  # torchrun's workers have no MPI launcher to join
    result = run_cli("submit", "jobs/smoke.yaml", "--site", "local-slurm", *TWO_BY_TWO, *IN_IMAGE, *launcher,
                     *storage_sets(slurm_storage), "--set", f"params.mpi={str(mpi).lower()}", "--wait", timeout=240)
    assert result.code == 0, result.text
    assert "finished: COMPLETED; 4/4 ranks succeeded" in result.out, result.out
    assert re.search(r'rank 3: ok \{"host": "n2", "sum": 6.0, "mpi_sum": ' + ("6" if mpi else "null"), result.out)
    line = launch_line(slurm_storage, "smoke", job_id(result.out))
    assert "ch-run --bind=/var/tmp/hpcdist-shared:/var/tmp/hpcdist-shared" in line  # the roots' mount point
    assert f"{IMAGE} -- env -u PYTHONPATH PYTHONNOUSERSITE=1 python3 " in line


@pytest.mark.slurm
def test_a_users_script_on_hpcdist_init_runs_inside_the_image(slurm_storage: Path) -> None:
    result = run_cli("submit", "--site", "local-slurm", *TWO_BY_TWO, *IN_IMAGE, *storage_sets(slurm_storage),
                     "--wait", "--", str(REPO / "tests" / "scripts" / "in_image.py"), timeout=240)
    assert result.code == 0, result.text
    folder = next(p for p in (slurm_storage / "logs" / "in_image").iterdir() if p.name.isdigit())
    said = [json.loads(ln.split(" ", 1)[1]) for p in sorted(folder.glob("*_log.out"))
            for ln in p.read_text().splitlines() if ln.startswith("in_image ")]
    assert sorted(r["rank"] for r in said) == [0, 1, 2, 3] and {r["host"] for r in said} == {"n1", "n2"}
    assert {r["sum"] for r in said} == {10.0}
    assert {r["python"] for r in said} == {"/usr/bin/python3"}  # the image's Debian Python, not the host's venv
    assert all(r["inside"] for r in said)  # ch-run's CH_RUNNING


@pytest.mark.slurm
def test_an_executor_function_runs_in_the_image_and_returns(slurm_storage: Path) -> None:
    import hpcdist

    def where(ctx: hpcdist.Context, offset: int) -> dict[str, object]:  # pickled by value: not importable inside
        import os
        import sys

        return {"rank": ctx.rank + offset, "python": sys.executable, "inside": bool(os.environ.get("CH_RUNNING"))}

    roots = {f"site.storage.{key}": str(slurm_storage / key) for key in ("results", "checkpoints", "scratch", "logs")}
    ex = hpcdist.Executor(site="local-slurm", nodes=2, tasks_per_node=1, time_min=5,
                          container={"runtime": "charliecloud", "image": str(IMAGE)}, set=roots)
    assert ex.submit(where, 10).results() == [{"rank": 10, "python": "/usr/bin/python3", "inside": True},
                                              {"rank": 11, "python": "/usr/bin/python3", "inside": True}]


@pytest.mark.slurm
def test_train_gpt_preempted_in_the_image_is_requeued_outside_and_resumes_bit_for_bit(
        train_root: Path, tokens: Path, reference: Path) -> None:
    root = train_root / "container-preempt"
    jid, result = preempted_slurm_run(root, tokens, "USR2", "--set", "sbatch.nodelist=n1,n2", *IN_IMAGE)
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in result.out
    batch = (root / "logs" / "train_gpt" / jid / f"{jid}_0_log.err").read_text()
    assert f"hpcdist: requeueing job {jid}, as its ranks in the container asked" in batch  # scontrol, outside
    log = rank_log(root, 0)
    stopped = stopped_at(log, "USR2")
    assert 20 <= stopped < STEPS
    assert f"resumed from {ckpt_dir(root) / f'step_{stopped:08d}.h5'}: step {stopped}" in log
    assert differing(final_checkpoint(root), reference) == []
    attrs = read_attrs(result_path(result.out))
    assert attrs["requeues"] == 1 and attrs["final_step"] == STEPS


@pytest.mark.slurm
def test_a_member_of_the_shared_site_runs_the_smoke_job_in_the_image() -> None:
    require_members()
    name = f"smoke-ct-{os.getpid()}"
    try:
        run = as_user("alice", "-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "smoke.yaml"), "--site",
                      "local-group", "--set", f"name={name}", *TWO_BY_TWO[:4], *IN_IMAGE, "--wait")
        assert run.code == 0, run.text
        assert "finished: COMPLETED; 4/4 ranks succeeded" in run.out, run.out
        result = GROUP_ROOT / "results" / "alice" / name / f"{job_id(run.out)}.h5"
        assert result.is_file() and result.owner() == "alice"
    finally:
        for folder in GROUP_ROOT.glob(f"*/alice/{name}"):
            shutil.rmtree(folder, ignore_errors=True)

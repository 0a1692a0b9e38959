"""The local site's GPUs are the machine's: counted at submit (``nvidia-smi -L``, within the
shell's ``CUDA_VISIBLE_DEVICES``), given to the tasks of a job that asks for them and hidden from
one that asks none, which submit says in one line, and the failure summary again when a rank
fails on CUDA finding no GPU; asking more than there are is one error at submit.

This machine has no GPU: a stand-in ``nvidia-smi`` on PATH lists two, and each rank's
environment is read back through the front door (``hpcdist submit``, ``hpcdist.Executor``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hpcdist
from hpcdist.errors import ConfigError
from hpcdist.scheduler import local_jobs
from tests.support.cli import run_cli, storage_sets

UUIDS = ("GPU-1b7c42e0-9d1a-4c55-8e33-0f2d6a1c9b01", "GPU-f60acc4e-2b3d-4e8f-9a71-55c0e2d4b7aa")
SMI = "#!/bin/sh\n[ \"$1\" = -L ] || exit 9\n" + "".join(
    f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {u})'\n" for i, u in enumerate(UUIDS))


@pytest.fixture
def two_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """PATH with an nvidia-smi that lists two GPUs (in this process and the CLI's)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    monkeypatch.setenv("PATH", path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    local_jobs._listed_gpus.cache_clear()
    yield {"PATH": path}
    local_jobs._listed_gpus.cache_clear()


def visible_devices() -> dict[str, Any]:
    return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}


def executor(tmp_path: Path, **keys: Any) -> hpcdist.Executor:
    sets = {f"site.storage.{k}": str(tmp_path / "out" / k) for k in ("results", "checkpoints", "scratch", "logs")}
    return hpcdist.Executor(tmp_path / "jobs" / "%j", site="local", timeout_min=2, set=sets, **keys)


def test_the_machines_gpus_as_cuda_names_them(two_gpus: dict[str, str]) -> None:
    assert local_jobs.machine_gpus({}) == ("0", "1")
    assert local_jobs.machine_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == ("1",)
    assert local_jobs.machine_gpus({"CUDA_VISIBLE_DEVICES": f"{UUIDS[1][:12]},0"}) == (UUIDS[1][:12], "0")
    # CUDA stops at the first entry that names no GPU; so does the count
    assert local_jobs.machine_gpus({"CUDA_VISIBLE_DEVICES": "1,7,0"}) == ("1",)
    assert local_jobs.machine_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()


def test_a_job_that_asks_for_a_gpu_gets_one(two_gpus: dict[str, str], tmp_path: Path) -> None:
    job = executor(tmp_path, gpus_per_node=1).submit(visible_devices)
    assert job.result() == {"CUDA_VISIBLE_DEVICES": "0"}


def test_the_shells_own_choice_of_gpus_is_kept(two_gpus: dict[str, str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    job = executor(tmp_path, gpus_per_node=1).submit(visible_devices)
    assert job.result() == {"CUDA_VISIBLE_DEVICES": "1"}


def test_a_job_that_asks_none_sees_none(two_gpus: dict[str, str], tmp_path: Path) -> None:
    job = executor(tmp_path).submit(visible_devices)
    assert job.result() == {"CUDA_VISIBLE_DEVICES": ""}


def test_more_gpus_than_the_machine_has_is_refused_at_submit(two_gpus: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"resources.gpus_per_node.*3.*at most 2 on partition 'local' "
                                          r"\(the GPUs `nvidia-smi -L` lists on this machine"):
        executor(tmp_path, gpus_per_node=3, tasks_per_node=3).submit(visible_devices)
    assert not (tmp_path / "jobs").exists()  # nothing was started


def test_without_nvidia_smi_a_gpu_job_is_refused_at_submit(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    result = run_cli("submit", "--site", "local", "--set", "resources.gpus_per_node=1", *storage_sets(tmp_path),
                     "--wait", "--", str(script), env={"PATH": "/usr/bin:/bin"})
    assert result.code == 2, result.text
    assert "resources.gpus_per_node" in result.err and "at most 0 on partition 'local'" in result.err, result.err
    assert "Traceback" not in result.err


def test_every_rank_of_a_submitted_script_sees_the_jobs_gpus(two_gpus: dict[str, str], tmp_path: Path) -> None:
    """Two ranks, two GPUs asked: each task sees both (the binding "none", cuda:LOCAL_RANK); with
    torch's CPU wheel each rank then stops at the bootstrap's check, which names what it saw."""
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    result = run_cli("submit", "--site", "local", "--set", "resources.gpus_per_node=2", "--set",
                     "resources.tasks_per_node=2", "--set", "timeout_s=20", *storage_sets(tmp_path), "--wait", "--",
                     str(script), env=two_gpus)
    assert result.code == 1, result.text
    for rank in (0, 1):
        assert (f"rank {rank}: FAILED BootstrapError: job asks for GPUs (gpus_per_node=2, backend=auto) but on "
                in result.out), result.out
    assert result.out.count("CUDA_VISIBLE_DEVICES='0,1' is set but torch sees no usable GPU") == 2, result.out


H200 = ("#!/bin/sh\n[ \"$1\" = -L ] || exit 9\n"
        "echo 'GPU 0: NVIDIA H200 (UUID: GPU-5c2a9e31-7d44-4b0e-a1f3-9e8d2c6b4a10)'\n")
UNASKED = ("this job asks no GPUs on a machine with 1, so its ranks get none; "
           "add --set resources.gpus_per_node=1 to give each rank one")


@pytest.mark.parametrize(("error", "said"), [("RuntimeError('No CUDA GPUs are available')", True),
                                             ("ValueError('bad batch size')", False)])
def test_a_job_that_asks_no_gpu_on_a_gpu_machine_is_told_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            error: str, said: bool) -> None:
    """PyTorch's DDP tutorial, unchanged (`multinode.py 3 1`), on an H200 machine: it asks no GPU, so
    it gets none and fails as under submitit and Slurm, but submit says why in one line, and the
    summary says it again when the rank failed on CUDA finding no GPU (not for another error).
    This machine has no GPU: a stand-in ``nvidia-smi`` on PATH lists one H200, as the real one would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(H200)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    script = tmp_path / "multinode.py"
    script.write_text(f"import sys\nprint('epochs', sys.argv[1:])\nraise {error}\n")
    result = run_cli("submit", "--site", "local", *storage_sets(tmp_path / "out"), "--wait", "--", str(script),
                     "3", "1", env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert result.code == 1, result.text
    lines = result.out.splitlines()
    assert f"  note: {UNASKED}" in lines, result.out  # at submit, before the job ran
    assert lines.index(f"  note: {UNASKED}") < next(i for i, ln in enumerate(lines) if " finished: FAILED" in ln)
    summary = f"  note: CUDA found no GPU in the ranks: {UNASKED}"
    assert (summary in lines) is said, result.out
    assert "rank 0: FAILED" in result.out and error.split("(")[0] in result.out, result.out

"""Every name a submitit user imports, with submitit's meaning (issue 68, item 2): ``import hpcdist
as submitit`` runs a submitit script. ``LocalExecutor`` is this machine wherever srun is on PATH,
``DebugExecutor`` runs in the process, ``SlurmExecutor`` takes Slurm's parameter names, ``helpers``
is submitit's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import submitit

import hpcdist
from hpcdist.errors import ConfigError
from tests.support.cli import REPO

SCRIPT = REPO / "tests" / "scripts" / "submitit_example.py"


def test_each_public_name_of_submitit_is_in_hpcdist_with_its_meaning(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    public = {n for n in dir(submitit) if not n.startswith("_")} - {"auto", "core", "local", "slurm"}  # (modules)
    assert {n for n in public if not hasattr(hpcdist, n)} == set()
    assert hpcdist.helpers is submitit.helpers and hpcdist.DebugExecutor is submitit.DebugExecutor
    assert hpcdist.JobEnvironment is submitit.JobEnvironment
    assert hpcdist.Job is hpcdist.JobHandle and hpcdist.Job[int].__origin__ is hpcdist.JobHandle
    monkeypatch.setenv("HPCDIST_SITE", "local-slurm")  # a Slurm site named: LocalExecutor stays here
    local = hpcdist.LocalExecutor(tmp_path / "%j")
    assert (local.site.name, local.cluster) == ("local", "local")


def test_slurm_executor_takes_slurms_own_parameter_names(tmp_path: Path) -> None:
    ex = hpcdist.SlurmExecutor(tmp_path / "%j", site="local-slurm")
    ex.update_parameters(partition="gpu", time=5, nodes=2, ntasks_per_node=2, cpus_per_task=2, gpus_per_node=2,
                         mem="2GB", job_name="sweep", additional_parameters={"comment": "hi"}, exclude="n4",
                         setup=["echo hi"], signal_delay_s=30)
    assert ex._data["resources"] == {"partition": "gpu", "time_min": 5, "nodes": 2, "tasks_per_node": 2,
                                     "cpus_per_task": 2, "gpus_per_node": 2, "mem_gb": 2.0}
    assert (ex._data["name"], ex._data["sbatch"]) == ("sweep", {"comment": "hi", "exclude": "n4"})
    assert ex.site.setup[-1] == "echo hi" and ex.site.preemption.seconds_before_end == 30
    ex.update_parameters(mem="512M")
    assert ex._data["resources"]["mem_gb"] == 0.5
    with pytest.raises(ConfigError, match="mem='lots' is not a size Slurm reads"):
        ex.update_parameters(mem="lots")
    with pytest.raises(ConfigError, match=r"^hpcdist.SlurmExecutor: use_srun=False has no meaning here: hpcdist "):
        ex.update_parameters(use_srun=False)


@pytest.mark.slurm
def test_a_submitit_script_runs_with_only_its_import_line_changed(tmp_path: Path) -> None:
    """The script's LocalExecutor jobs run here, its DebugExecutor job in its own process, its
    SlurmExecutor job on the cluster, with submitit's parameter names and helpers throughout."""
    from tests.support.cli import require_slurm

    require_slurm()
    original = SCRIPT.read_text().splitlines(keepends=True)
    changed = [("import hpcdist as submitit\n" if line == "import submitit\n" else line) for line in original]
    assert sum(a != b for a, b in zip(original, changed, strict=True)) == 1
    script = tmp_path / "example.py"
    script.write_text("".join(changed))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPCDIST_SITE": "local-slurm"}
    got = subprocess.run([sys.executable, str(script), str(tmp_path / "logs"), "--slurm"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240, check=False)
    assert got.returncode == 0, got.stdout + got.stderr
    assert json.loads(got.stdout.splitlines()[-1]) == {
        "local_map": [11, 22], "checkpointable": 8, "local_env": 1, "debug_in_process": True, "delayed": 9,
        "clean_env": True, "slurm": [5, "COMPLETED"]}, got.stdout

"""``hydra/launcher=hpcdist``: Hydra's own launcher test suites (hydra-core's
``hydra.test_utils.launcher_common_tests``) against it, in full on the local site and in part on
the local Slurm cluster, and what hydra-submitit-launcher lacks: failed jobs FAILED, ``wait: false``,
every sbatch option by name.

The Slurm part of Hydra's suites: ``test_sweep_1_job`` (its ``hydra.job.id`` Slurm's),
``test_sweep_2_jobs`` (a Slurm job array; ``multirun.yaml`` and a folder per job, as Hydra writes
them), ``test_sweep_and_override`` (each job's config composed on the node from its overrides),
and the integration suite's ``test_custom_sweeper_run_workdir`` (a job's working directory on the
node, from a relative sweep folder and from ``override_dirname``). The others differ from these
only in what Hydra does before the launcher (composition errors, config groups, resolvers, the
task's name), which the local site runs in full; a task that raises on a node is the last test.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

from hpcdist.config.spec import Resources
from hpcdist.errors import ConfigError
from hydra_plugins.hpcdist_launcher.config import HpcdistLauncherConf
from tests.support.cli import REPO, run_cli

# hydra-submitit-launcher 1.2's SlurmQueueConf, whose configs load here unchanged
SUBMITIT_SLURM_KEYS = {
    "submitit_folder", "timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
    "stderr_to_stdout", "partition", "qos", "comment", "constraint", "exclude", "gres", "cpus_per_gpu",
    "gpus_per_task", "mem_per_gpu", "mem_per_cpu", "account", "signal_delay_s", "max_num_timeout", "python",
    "additional_parameters", "array_parallelism", "setup", "srun_args"}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local site's storage is relative to where hpcdist runs: a test's own folder."""
    monkeypatch.chdir(tmp_path)


def slurm_site(root: Path) -> str:
    """The launcher's override for the local Slurm cluster, its storage under `root`."""
    storage = ",".join(f"{k}:{root / k}" for k in ("results", "checkpoints", "scratch", "logs"))
    return f"+hydra.launcher.set.site={{launcher:{{args:[]}},storage:{{{storage}}}}}"


def test_hydra_finds_the_launcher_and_its_config_takes_every_resource_and_submitits_names() -> None:
    found = [f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)]
    assert HpcdistLauncherConf._target_ in found  # the class Hydra's scan of hydra_plugins found
    assert ConfigStore.instance().load("hydra/launcher/hpcdist.yaml").provider == "hpcdist"
    keys = {f.name for f in dataclasses.fields(HpcdistLauncherConf)}
    assert set(Resources.model_fields) - keys == set()
    assert SUBMITIT_SLURM_KEYS - keys == set()
    assert {"site", "sbatch", "wait", "set"} <= keys


def test_a_meaningless_submitit_key_is_one_line_with_its_reason() -> None:
    from hpcdist.login.hydra_sweep import executor

    with pytest.raises(ConfigError, match=r"hydra/launcher=hpcdist: .*gpus_per_task=1.*gpus_per_node"):
        executor({"gpus_per_task": 1})
    with pytest.raises(ConfigError, match=r"hydra/launcher=hpcdist: .*gpus_per_node: 99"):
        executor({"site": "local-slurm", "gpus_per_node": 99})


@pytest.mark.parametrize(("launcher_name", "overrides"), [("hpcdist", [])])
class TestHydraSuiteLocal(LauncherTestSuite):
    """Hydra's LauncherTestSuite in full, on the local site."""


@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"), [
    ({}, ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled", "hydra/launcher=hpcdist"])])
class TestHydraIntegrationLocal(IntegrationTestSuite):
    """Hydra's IntegrationTestSuite in full, on the local site (each test an app in a process of its own)."""


@pytest.mark.slurm
class TestHydraSuiteSlurm(LauncherTestSuite):
    """Hydra's LauncherTestSuite on the local Slurm cluster: the tests named in the module's docstring."""

    test_sweep_1_job_strict_and_bad_key = test_not_sweeping_hydra_overrides = None
    test_sweep_1_job_strict = None
    test_sweep_2_optimizers = test_sweep_over_unspecified_mandatory_default = None
    test_sweep_with_custom_resolver = None

    @pytest.fixture
    def launcher_name(self) -> str:
        return "hpcdist"

    @pytest.fixture
    def overrides(self, slurm_storage: Path) -> list[str]:
        return ["hydra.launcher.site=local-slurm", "hydra.launcher.time_min=5", slurm_site(slurm_storage)]


@pytest.mark.slurm
class TestHydraIntegrationSlurm(IntegrationTestSuite):
    """A job's working directory on a node, from a relative sweep folder."""

    test_custom_task_name = test_get_orig_dir_multirun = test_to_absolute_path_multirun = None

    @pytest.fixture
    def task_launcher_cfg(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def extra_flags(self, slurm_storage: Path) -> list[str]:
        return ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled", "hydra/launcher=hpcdist",
                "hydra.launcher.site=local-slurm", "hydra.launcher.time_min=5", slurm_site(slurm_storage)]


APP = """
import hydra

@hydra.main(version_base=None, config_path=None)
def main(cfg):
    if cfg.fail:
        raise ValueError(f"lr {cfg.lr} diverged")
    import hpcdist
    ctx = hpcdist.init()
    return {"rank": ctx.rank, "world": ctx.world_size, "lr": cfg.lr}

if __name__ == "__main__":
    main()
"""


def test_on_slurm_a_sweep_returns_at_once_with_its_ids_and_its_failed_job_is_failed(slurm_storage: Path,
                                                                                     tmp_path: Path) -> None:
    """wait: false on 2 nodes a job, with Slurm's account, QOS and comment by name: the ids and
    the command come back while the jobs are queued; Slurm then says FAILED for the job whose
    task raised (hydra-submitit-launcher's says COMPLETED), and each job's folder is Hydra's."""
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    sweep = tmp_path / "sweep"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "hydra/launcher=hpcdist", "hydra.launcher.site=local-slurm",
         "hydra.launcher.wait=false", "hydra.launcher.nodes=2", "hydra.launcher.time_min=5",
         "hydra.launcher.account=root", "hydra.launcher.qos=normal", "hydra.launcher.comment=hydra-sweep",
         slurm_site(slurm_storage), f"hydra.sweep.dir={sweep}", "+lr=0.1,0.2", "+fail=false,true"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    queued_s = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("queued 4 jobs of the sweep on site local-slurm"))
    ids = line.rpartition(": ")[2].split()
    assert len(ids) == 4 and len({i.split("_")[0] for i in ids}) == 1  # one job array
    assert "  follow: hpcdist jobs --last 4" in proc.stdout
    assert (sweep / "multirun.yaml").is_file()
    assert queued_s < 30

    import hpcdist

    states = {}
    for job_id in ids:
        handle = hpcdist.job(job_id)
        handle.wait(timeout_s=180)
        states[job_id] = handle.state.value
    assert sorted(states.values()) == ["COMPLETED", "COMPLETED", "FAILED", "FAILED"]
    # Hydra's job N is overrides N: lr=0.1,fail=false / lr=0.1,fail=true / ...
    assert [states[i] for i in ids] == ["COMPLETED", "FAILED", "COMPLETED", "FAILED"]
    array = ids[0].split("_")[0]
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", array, "--format=JobID,NNodes,State"],
                           capture_output=True, text=True, timeout=30)
    assert sorted(r.split("|")[1:] for r in sacct.stdout.split()) == [["2", "COMPLETED"]] * 2 + [["2", "FAILED"]] * 2
    shown = subprocess.run(["scontrol", "show", "job", ids[0]], capture_output=True, text=True, timeout=30).stdout
    assert "Comment=hydra-sweep" in shown and "QOS=normal" in shown and "Account=root" in shown
    script = (slurm_storage / "logs" / "app-0" / array / f"{array}_submission.sh").read_text()
    assert "#SBATCH --account=root\n" in script and "#SBATCH --qos=normal\n" in script
    for n in range(4):  # Hydra's own files of each job, rank 0's
        assert (sweep / str(n) / ".hydra" / "overrides.yaml").is_file()
    failed = run_cli("wait", ids[1])
    assert failed.code != 0 and "ValueError: lr 0.1 diverged" in failed.out + failed.err

"""``hydra/launcher=hpcdist``: Hydra's own launcher test suites (hydra-core's
``hydra.test_utils.launcher_common_tests``: LauncherTestSuite, IntegrationTestSuite, and
BatchedSweeperTestSuite for a sweep in batches) against it, in full on the local site and in part
on the local Slurm cluster, and what hydra-submitit-launcher lacks: failed jobs FAILED, ``wait: false``,
every sbatch option by name.

The Slurm part of Hydra's suites: ``test_sweep_1_job`` (its ``hydra.job.id`` Slurm's),
``test_sweep_2_jobs`` (a Slurm job array; ``multirun.yaml`` and a folder per job, as Hydra writes
them), ``test_sweep_and_override`` (each job's config composed on the node from its overrides),
and two cases of the integration suite's ``test_custom_sweeper_run_workdir`` (a job's working
directory on the node, from a relative sweep folder and from ``override_dirname``). The others differ from these
only in what Hydra does before the launcher (composition errors, config groups, resolvers, the
task's name), which the local site runs in full; a task that raises on a node is the last test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
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
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite

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


def test_nodes_whose_python_lacks_hydra_are_one_line_saying_what_to_install() -> None:
    from hpcdist.login.hydra_sweep import executor

    bare = "/usr/bin/python3"  # Debian's, with neither hydra-core nor hpcdist
    with pytest.raises(ConfigError) as missing:
        executor({"set": {"site": {"python": bare}}})
    assert str(missing.value) == (f"hydra/launcher=hpcdist: the nodes' python {bare} (site.python) cannot import "
                                  f"hydra and hpcdist; install them there: {bare} -m pip install 'hpcdist[hydra]'")


def test_the_readmes_hydra_app_without_hydra_installed_is_one_line_saying_what_to_install(tmp_path: Path) -> None:
    blocker = tmp_path / "sitecustomize.py"  # this Python as one where `pip install 'hpcdist[hydra]'` was not done
    blocker.write_text("import sys\nsys.modules['hydra'] = None\n")
    app = str(REPO / "examples" / "hydra_train_gpt.py")
    proc = subprocess.run([sys.executable, app, "-m", "hydra/launcher=hpcdist"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("hpcdist: error: this example is a Hydra app and Hydra is not installed"), proc.stderr
    assert proc.stderr.endswith("pip install 'hpcdist[hydra]', then run it again\n"), proc.stderr


@pytest.mark.parametrize(("launcher_name", "overrides"), [("hpcdist", [])])
class TestHydraSuiteLocal(LauncherTestSuite):
    """Hydra's LauncherTestSuite in full, on the local site."""


@pytest.mark.parametrize(("launcher_name", "overrides"), [("hpcdist", ["hydra.sweeper.max_batch_size=2"])])
class TestHydraBatchesLocal(BatchedSweeperTestSuite):
    """Hydra's sweep in batches of 2: job N of the sweep is hpcdist's job <name>-N across batches."""

    def test_sweep_2_jobs_2_batches(self, hydra_sweep_runner: Any, launcher_name: str, overrides: list[str],
                                    tmpdir: Path) -> None:
        super().test_sweep_2_jobs_2_batches(hydra_sweep_runner, launcher_name, overrides, tmpdir)
        jobs = json.loads(run_cli("jobs", "--json").out)
        assert sorted(j["name"] for j in jobs) == [f"a_module-{n}" for n in range(6)]


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

    @pytest.mark.parametrize(("task_config", "overrides", "expected_dir"), [
        pytest.param({}, ["hydra.sweep.dir=cli_dir", "hydra.sweep.subdir=cli_dir_${hydra.job.num}"],
                     "cli_dir/cli_dir_0", id="sweep_dir_cli_override"),
        pytest.param({"hydra": {"sweep": {"dir": "hydra_cfg", "subdir": "${hydra.job.override_dirname}"}},
                      "a": "hello", "b": 20}, ["a=1", "b=2"], "hydra_cfg/a=1,b=2", id="subdir:override_dirname"),
    ])
    def test_custom_sweeper_run_workdir(self, tmpdir: Path, task_config: Any, overrides: list[str], expected_dir: str,
                                        task_launcher_cfg: Any, extra_flags: list[str]) -> None:
        """Two of Hydra's five cases: a relative sweep folder, and a folder named by the overrides."""
        super().test_custom_sweeper_run_workdir(tmpdir, task_config, overrides, expected_dir, task_launcher_cfg,
                                                extra_flags)


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
    """wait: false on 2 nodes a job, 2 at a time, with Slurm's account, QOS and comment by name, and
    no site named (on a login node: the cluster srun talks to): the ids and the command come back
    while the jobs are queued; Slurm then says FAILED for the jobs whose task raised
    (hydra-submitit-launcher's say COMPLETED), and each job's folder is Hydra's."""
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    sweep = tmp_path / "sweep"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "hydra/launcher=hpcdist", "hydra.launcher.wait=false",
         "hydra.launcher.nodes=2", "hydra.launcher.time_min=5",
         "hydra.launcher.account=root", "hydra.launcher.qos=normal", "hydra.launcher.comment=hydra-sweep",
         "hydra.launcher.array_parallelism=2",
         slurm_site(slurm_storage), f"hydra.sweep.dir={sweep}", "+lr=0.1,0.2", "+fail=false,true"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "HPCDIST_SITE"}, "PYTHONPATH": str(REPO)})
    queued_s = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no site named: Slurm's srun is on PATH, so jobs go to that cluster" in proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("queued 4 jobs of the sweep on site "))
    assert " local" not in line
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
    assert "#SBATCH --array=0-3%2\n" in script
    for n in range(4):  # Hydra's own files of each job, rank 0's
        assert (sweep / str(n) / ".hydra" / "overrides.yaml").is_file()
    failed = run_cli("wait", ids[1])
    assert failed.code != 0 and "ValueError: lr 0.1 diverged" in failed.out + failed.err


RESUMABLE = """
import pathlib, time
import hydra

@hydra.main(version_base=None, config_path=None)
def main(cfg):
    mark = pathlib.Path("started")  # in the job's own folder (hydra.job.chdir)
    if mark.exists():
        return print("resumed", flush=True)
    mark.touch()
    time.sleep(60)

if __name__ == "__main__":
    main()
"""


def test_a_job_stopped_at_its_time_limit_is_requeued_and_runs_again(tmp_path: Path) -> None:
    """submitit's Checkpointable: the signal before the time limit requeues the same Hydra job,
    whose task finds what its first run left in its folder. The signal comes 15 s after the start
    (45 s limit, 30 s warning): time for the task to start on a loaded machine."""
    (tmp_path / "app.py").write_text(textwrap.dedent(RESUMABLE))
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "hydra/launcher=hpcdist", "hydra.launcher.timeout_min=0.75",
         "hydra.launcher.signal_delay_s=30", "hydra.launcher.max_num_timeout=1", "hydra.job.chdir=true",
         "hydra.sweep.dir=sweep", "+x=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "sweep" / "0" / "started").is_file()
    import hpcdist

    (listed,) = json.loads(run_cli("jobs", "--json", cwd=tmp_path).out)  # this test's own job index
    job = hpcdist.job(listed["job_id"])
    assert job.state is hpcdist.JobState.COMPLETED
    assert "resumed" in (job.stdout() or "")


def shown(page: str) -> list[str]:
    """The guide's `python examples/hydra_train_gpt.py ...` line of `page`, as argv."""
    text = re.sub(r"\\\n\s*", " ", (REPO / page).read_text())
    (line,) = [x.strip() for x in text.splitlines() if x.strip().startswith("python examples/hydra_train_gpt.py")]
    return shlex.split(line)


def run_shown(argv: list[str], cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The line as the guide shows it (its example from this checkout), with `extra` overrides."""
    assert run_cli("data", "prepare", str(REPO / "README.md"), "-o", str(cwd / "tokens.h5")).code == 0
    full = [sys.executable, str(REPO / argv[1]), *argv[2:], *extra]
    proc = subprocess.run(full, cwd=cwd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_readmes_hydra_sweep_runs_on_this_machine(tmp_path: Path) -> None:
    run_shown(shown("README.md"), tmp_path)
    jobs = json.loads(run_cli("jobs", "--json", cwd=tmp_path).out)
    assert sorted((j["name"], j["state"]) for j in jobs) == [("hydra_train_gpt-0", "COMPLETED"),
                                                             ("hydra_train_gpt-1", "COMPLETED")]
    assert all(Path(j["result"]).is_file() for j in jobs)  # train_gpt's result file


def test_the_python_api_pages_sweep_of_train_gpt_over_4_values_on_2_nodes_each(slurm_storage: Path,
                                                                               tmp_path: Path) -> None:
    argv = shown("docs/python-api.md")
    assert "hydra.launcher.nodes=2" in argv and "params.optim.lr=1e-3,6e-4,3e-4,1e-4" in argv
    run_shown(argv, tmp_path, "hydra.launcher.site=local-slurm", slurm_site(slurm_storage), "hydra.sweep.dir=sweep")
    jobs = json.loads(run_cli("jobs", "--json", cwd=tmp_path).out)
    assert sorted((j["name"], j["state"]) for j in jobs) == [(f"hydra_train_gpt-{n}", "COMPLETED") for n in range(4)]
    (array,) = {j["job_id"].split("_")[0] for j in jobs}  # one job array
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", array, "--format=NNodes"], capture_output=True, text=True,
                           timeout=30)
    assert sacct.stdout.split() == ["2"] * 4
    assert all(Path(j["result"]).is_file() for j in jobs)
    lrs = [(tmp_path / "sweep" / str(n) / ".hydra" / "overrides.yaml").read_text() for n in range(4)]
    assert [float(x.split("params.optim.lr=")[1].split()[0]) for x in lrs] == [1e-3, 6e-4, 3e-4, 1e-4]


def test_a_sweep_whose_task_raised_fails_with_the_error_after_every_job_ended(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    proc = subprocess.run([sys.executable, "app.py", "-m", "hydra/launcher=hpcdist", "+lr=0.5", "+fail=true,false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and "ValueError: lr 0.5 diverged" in proc.stderr, proc.stdout + proc.stderr
    jobs = json.loads(run_cli("jobs", "--json", cwd=tmp_path).out)
    assert sorted((j["name"], j["state"]) for j in jobs) == [("app-0", "FAILED"), ("app-1", "COMPLETED")]

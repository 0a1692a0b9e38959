"""``hpcdist.Executor`` used as submitit's executor is used: its arguments and parameter names,
its job API and error types, ``batch()``, ``Checkpointable``, and the plain function that pays no
torch. Written here against hpcdist (no code copied from submitit); submitit's own tests run
against it outside the suite (docs/python-api.md says how, and what differs on purpose).
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import submitit
from submitit.core.utils import DelayedSubmission, FailedJobError, UncompletedJobError
from submitit.helpers import Checkpointable, as_completed, monitor_jobs

import hpcdist
from hpcdist.errors import ConfigError
from tests.support.train import preempt_and_release

SLURM = {"site.launcher.args": []}  # srun without --mpi=pmix, as the rest of the suite


def storage(root: Path) -> dict[str, Any]:
    return {f"site.storage.{key}": str(root / key) for key in ("results", "checkpoints", "scratch", "logs")}


def local(tmp_path: Path, **keys: Any) -> hpcdist.Executor:
    """submitit's first argument, the folder; hpcdist's other storage under the same test folder."""
    return hpcdist.Executor(tmp_path / "jobs" / "%j", set=storage(tmp_path), **keys)


def heavy_modules() -> dict[str, Any]:
    """What a plain function sees of hpcdist's machinery in its own process."""
    return {"torch": "torch" in sys.modules, "bootstrap": "hpcdist.runtime.bootstrap" in sys.modules,
            "pid": os.getpid()}


def task_rank(scale: int) -> int:
    """submitit's own description of the task, read as submitit's users read it."""
    env = submitit.JobEnvironment()
    print(f"out of task {env.global_rank}", flush=True)
    print(f"err of task {env.global_rank}", file=sys.stderr, flush=True)
    return scale * env.global_rank


def raise_on_upper_ranks() -> None:
    rank = submitit.JobEnvironment().global_rank
    if rank > 0:
        raise RuntimeError(f"raised on purpose by task {rank}")


def add(x: int, y: int) -> int:
    return x + y


def with_init() -> dict[str, Any]:
    ctx = hpcdist.init()
    ctx.checkpoints.save(1, {"w": 1})
    return {"rank": ctx.rank, "world": ctx.world_size, "dir": str(ctx.checkpoints.directory)}


class Resumable(Checkpointable):
    """Works `seconds`, unless resumed: the requeued run says so and what it was told."""

    def __call__(self, seconds: float, resumed: int = 0) -> str:
        if resumed:
            return f"resumed {resumed}"
        print("working", flush=True)
        time.sleep(seconds)
        return "never interrupted"

    def __submitit_checkpoint__(self, seconds: float, resumed: int = 0) -> DelayedSubmission:
        print("checkpointing", flush=True)
        return DelayedSubmission(self, seconds, resumed=resumed + 1)


def test_submitits_arguments_and_names_are_taken(tmp_path: Path) -> None:
    """``Executor(folder)`` with submitit's names: ``timeout_min`` (a fraction too), another
    cluster's prefix ignored, ``local_setup`` run before the task, ``stderr_to_stdout``."""
    marker = tmp_path / "setup-ran"
    ex = local(tmp_path, timeout_min=1.5, slurm_partition="ignored-here", local_setup=[f"touch {marker}"],
               stderr_to_stdout=True, cpus_per_task=1, mem_gb=1, nodes=1, tasks_per_node=1, name="named",
               gpus_per_node=0, python=sys.executable)
    job = ex.submit(task_rank, 3)
    assert job.result() == 0
    assert marker.exists()
    assert Path(job.paths.folder) == tmp_path / "jobs" / job.job_id
    out = job.stdout() or ""
    assert "out of task 0" in out and "err of task 0" in out, out  # stderr in the stdout file
    assert job.record.name == "named" and ex.cluster == "local" and ex.site.python == sys.executable
    auto = hpcdist.AutoExecutor(tmp_path / "auto", cluster="local")
    assert auto.submit(add, 2, 3).result() == 5


def test_a_plain_function_runs_without_torch_or_bootstrap_and_init_still_works(tmp_path: Path) -> None:
    ex = local(tmp_path)
    seen = ex.submit(heavy_modules).result()
    assert seen["torch"] is False and seen["bootstrap"] is False, seen
    got = ex.submit(with_init).result()  # hpcdist.init() in such a function: the job's own checkpoints
    assert got == {"rank": 0, "world": 1, "dir": str(tmp_path / "checkpoints" / "with_init")}


def test_a_job_of_several_tasks_has_submitits_job_api(tmp_path: Path) -> None:
    ex = local(tmp_path, tasks_per_node=3)
    job = ex.submit(task_rank, 10)
    assert job.results() == [0, 10, 20]
    assert job.task(2).result() == 20 and job.task(1).results() == [10]
    with pytest.raises(ValueError, match="must be between 0 and 2"):
        job.task(3)
    assert job.exception() is None and job.done()
    assert job.state == "COMPLETED" and isinstance(job.state, str) and job.state is hpcdist.JobState.COMPLETED
    out, err = job.stdout() or "", job.stderr() or ""
    assert all(f"out of task {r}" in out for r in range(3)), out
    assert all(f"err of task {r}" in err for r in range(3)), err
    assert job.task(1).stdout() is not None and "out of task 1" in job.task(1).stdout()  # type: ignore[operator]
    assert asyncio.run(job.awaitable().results(poll_interval=0.2)) == [0, 10, 20]

    single = local(tmp_path).submit(add, 2, 3)

    async def as_they_come() -> list[int]:
        return [await f for f in single.awaitable().results_as_completed(poll_interval=0.2)]

    assert asyncio.run(as_they_come()) == [5]


def test_failures_and_cancels_are_submitits_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ex = local(tmp_path, tasks_per_node=3)
    failed = ex.submit(raise_on_upper_ranks)
    error = failed.exception()
    assert isinstance(error, FailedJobError) and isinstance(error, hpcdist.JobFailed)
    text = str(error.args[0])
    assert "Traceback" in text and "raised on purpose by task 1" in text and "raised on purpose by task 2" in text
    with pytest.raises(FailedJobError):
        failed.result()
    one = local(tmp_path)
    sleeper = one.submit(time.sleep, 60)
    assert sleeper.state == "RUNNING"
    sleeper.cancel()
    assert sleeper.state == "CANCELLED"
    with pytest.raises(UncompletedJobError) as uncompleted:
        sleeper.result()
    assert isinstance(uncompleted.value, hpcdist.JobFailed) and "CANCELLED" in str(uncompleted.value)
    done = one.submit(add, 1, 1)
    monitor_jobs([failed, done], poll_frequency=0.2, test_mode=True)  # submitit's helper, on hpcdist's handles
    assert "All jobs finished, jobs with indices [0] failed" in capsys.readouterr().out


def test_batch_submit_array_and_as_completed(tmp_path: Path) -> None:
    ex = local(tmp_path)
    with ex.batch():
        with pytest.raises(RuntimeError, match="with executor.batch"):
            ex.update_parameters(timeout_min=2)
        held = [ex.submit(add, 1, 2), ex.submit(add, 3, 4)]
    assert [j.result() for j in held] == [3, 7]
    jobs = ex.submit_array([functools.partial(add, i, i) for i in range(3)])
    assert sorted(j.result() for j in as_completed(jobs, poll_frequency=0.2)) == [0, 2, 4]
    assert [j.result() for j in jobs] == [0, 2, 4]


def test_a_nested_function_ships_as_submitit_ships_it(tmp_path: Path) -> None:
    """A function defined inside another travels by value, naming this module's globals by
    reference (the whole module is not pickled by value, which failed to import on the node)."""
    offset = 5

    def inner(x: int) -> int:
        return add(x, offset)

    assert local(tmp_path).submit(inner, 1).result() == 6


def test_a_job_shorter_than_the_sites_warning_runs_to_its_result(tmp_path: Path) -> None:
    """A 2-minute job under the site's default warning of 120 s: the signal comes at half the
    limit, not at the start (which stopped the job before its function ran, with an empty log)."""
    job = local(tmp_path, timeout_min=2).submit(heavy_modules)
    assert job.result()["torch"] is False
    assert job.state == "COMPLETED"


def test_checkpointable_is_called_at_the_time_limit_and_requeued(tmp_path: Path) -> None:
    """submitit's contract: at the time limit (less signal_delay_s) the callable's
    ``__submitit_checkpoint__`` is called and its DelayedSubmission runs again."""
    ex = local(tmp_path, timeout_min=4 / 60, signal_delay_s=1, max_num_timeout=1)
    job = ex.submit(Resumable(), 30)
    assert job.result() == "resumed 1"
    assert "checkpointing" in (job.stdout() or "")


def test_checkpointable_on_several_tasks_is_checkpointed_by_rank_zero_and_requeued(tmp_path: Path) -> None:
    """The same contract where hpcdist's bootstrap runs the function (two tasks): rank 0 calls the
    checkpoint at the signal, the job's call becomes the DelayedSubmission, every rank runs it."""
    ex = local(tmp_path, tasks_per_node=2, timeout_min=30 / 60, signal_delay_s=20, max_num_timeout=1)
    job = ex.submit(Resumable(), 12)  # the signal 10 s after each start; rank 1 sleeps on, then ends
    assert job.results(timeout_s=120) == ["resumed 1", "resumed 1"]
    assert "checkpointing" in (job.task(0).stdout() or "")


@pytest.mark.parametrize(("keys", "message"), [
    ({"local_visible_gpus": [0]}, "visible_gpus=[0] has no meaning here"),
    ({"gpus_per_task": 1}, "ask gpus_per_node instead"),
    ({"cluster": "debug"}, "cluster='debug'"),
    ({"cluster": "slurm", "site": "local"}, "cluster='slurm' but site 'local' is a local site"),
    ({"local_colour": "red"}, "unknown argument colour='red'"),
])
def test_what_has_no_meaning_is_one_error(tmp_path: Path, keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as bad:
        hpcdist.Executor(tmp_path, **keys)
    assert message in str(bad.value) and "\n" not in str(bad.value), str(bad.value)


def test_a_site_name_given_as_the_folder_says_which_argument_is_which(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"for the site write hpcdist.Executor\(site='local'\)"):
        hpcdist.Executor("local")


def test_slurm_parameters_become_the_scripts_lines(slurm_storage: Path) -> None:
    ex = hpcdist.AutoExecutor(slurm_storage / "jobs" / "%j", cluster="slurm", site="local-slurm",
                              set={**SLURM, **storage(slurm_storage)})
    ex.update_parameters(timeout_min=2.5, slurm_partition="cpu", slurm_additional_parameters={"comment": "parity"},
                         slurm_setup=["export PARITY_SETUP=1"], local_setup=["false"])
    job = ex.submit(heavy_modules)
    seen = job.result()
    assert seen["torch"] is False and seen["bootstrap"] is False
    script = Path(job.paths.submission_file).read_text()
    for line in ("#SBATCH --time=2:30", "#SBATCH --partition=cpu", "#SBATCH --comment=parity", "export PARITY_SETUP=1"):
        assert line in script, script
    with pytest.raises(ConfigError, match="use_srun=False has no meaning here"):
        ex.update_parameters(slurm_use_srun=False)


@pytest.mark.parametrize("nodes", [1, 2], ids=["one task, run by submitit", "two nodes, hpcdist's bootstrap"])
def test_a_checkpointable_preempted_on_the_cluster_is_requeued_and_resumes(slurm_storage: Path, nodes: int) -> None:
    """The site's preemption signal reaches the tasks: the checkpoint is called (by submitit's
    handler for one task, by rank 0 under hpcdist's bootstrap for several) and the job requeued
    through Slurm, which runs the DelayedSubmission it returned on every task."""
    ex = hpcdist.Executor(slurm_storage / "jobs" / "%j", site="local-slurm", timeout_min=5, nodes=nodes,
                          set={**SLURM, **storage(slurm_storage)})
    job = ex.submit(Resumable(), 120)
    deadline = time.monotonic() + 120
    while "working" not in (job.task(0).stdout() or ""):
        assert time.monotonic() < deadline, f"the task never started: {job.state}"
        time.sleep(0.5)
    preempt_and_release(job.job_id, "USR2")  # and Slurm's ~2-minute hold of a requeued job lifted
    assert job.results(timeout_s=240) == ["resumed 1"] * nodes
    restarts = subprocess.run(["scontrol", "show", "job", job.job_id], capture_output=True, text=True).stdout
    assert "Restarts=1" in restarts, restarts


def test_a_slurm_array_of_plain_functions_gives_each_item_its_own_job(slurm_storage: Path) -> None:
    """One script for the whole array: each task still reads its own item's name and storage
    when it calls ``hpcdist.init()`` (its checkpoints are its own)."""
    ex = hpcdist.Executor(slurm_storage / "jobs" / "%j", site="local-slurm", timeout_min=5,
                          set={**SLURM, **storage(slurm_storage)})
    jobs = ex.map_array(lambda _: with_init(), range(2))
    assert len({j.job_id.split("_")[0] for j in jobs}) == 1  # one Slurm job array
    got = [j.result(timeout_s=240) for j in jobs]
    names = [j.record.name for j in jobs]
    assert names[0].endswith("_lambda_-0") and names[1].endswith("_lambda_-1"), names
    assert [g["dir"] for g in got] == [str(slurm_storage / "checkpoints" / name) for name in names]

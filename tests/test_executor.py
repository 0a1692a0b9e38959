"""``hpcdist.Executor`` and ``hpcdist.job``: functions submitted from Python, on the local
Slurm cluster (2 nodes x 2 tasks) and on the local site, with every rank's return value back.

A function defined in this module travels by reference (the ``tests`` package is snapshot to
shared storage and imported there); one defined in ``__main__`` (a script, a notebook) by value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import hpcdist
from hpcdist.errors import ConfigError
from tests.support.cli import REPO, run_cli

SLURM = {"site.launcher.args": []}  # the suite's usual: srun without --mpi=pmix


def storage(root: Path) -> dict[str, Any]:
    return {f"site.storage.{key}": str(root / key) for key in ("results", "checkpoints", "scratch", "logs")}


def all_reduce_rank(ctx: hpcdist.Context, scale: int, offset: int = 0) -> dict[str, Any]:
    """Every rank's facts after an all_reduce over the group hpcdist made."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    assert hpcdist.init() is ctx  # the same context inside the function
    return {"rank": ctx.rank, "world": ctx.world_size, "host": ctx.hosts[ctx.rank], "sum": t.item(),
            "value": scale * 10 + offset}


def square(x: int) -> int:
    return x * x


def fail_on_rank_one(message: str) -> str:
    ctx = hpcdist.init()
    if ctx.rank == 1:
        raise ValueError(message)
    return "fine"


def unpicklable() -> Any:
    return threading.Lock()


def save_five(where: str) -> list[str]:
    """A function that sets its own checkpoint directory and keeps every checkpoint."""
    ctx = hpcdist.init(checkpoint_dir=where, keep_last=None)
    for step in range(1, 6):
        ctx.checkpoints.save(step, {"step": step})
    return sorted(p.name for p in Path(where).glob("step_*.h5"))


def boom_on_rank_two() -> str:
    """Rank 2 raises; the others wait in a barrier, and see their connections to it break."""
    import torch.distributed as dist

    ctx = hpcdist.init()
    if ctx.rank == 2:
        raise ValueError("bad value 7")
    dist.barrier()
    return "fine"


def remember(x: int) -> dict[str, Any]:
    """An item that resumes its own state, if any, and saves one checkpoint."""
    import time

    ctx = hpcdist.init()
    found = ctx.checkpoints.load_latest()
    start = time.time()
    time.sleep(1.0)
    ctx.checkpoints.save(1, {"x": x})
    return {"found": found is not None, "start": start, "end": time.time(), "dir": str(ctx.checkpoints.directory)}


def rename_itself() -> str:
    return hpcdist.init(name="other").name


def test_a_function_of_this_module_runs_on_two_nodes_and_returns_every_rank(slurm_storage: Path) -> None:
    ex = hpcdist.Executor(site="local-slurm", nodes=2, tasks_per_node=2, time_min=5,
                          set={**SLURM, **storage(slurm_storage), "sbatch.nodelist": "n1,n2"})
    job = ex.submit(all_reduce_rank, 4, offset=2)
    assert job.job_id.isdigit()
    values = job.results()
    assert [v["rank"] for v in values] == [0, 1, 2, 3]
    assert {v["world"] for v in values} == {4} and {v["sum"] for v in values} == {6.0}
    assert [v["host"] for v in values] == ["n1", "n1", "n2", "n2"]
    assert {v["value"] for v in values} == {42}
    assert job.result() == values[0]
    assert job.state is hpcdist.JobState.COMPLETED
    assert "all_reduce_rank" in job.record.name
    assert job.logs(rank=3) != "" or job.log_paths(3)[1].exists()


MAIN_SCRIPT = """
import json, sys
import hpcdist

def gather(ctx: hpcdist.Context, word):
    import torch, torch.distributed as dist
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    return f"{word}-{ctx.rank}-{int(t.item())}"

sets = json.loads(sys.argv[1])
ex = hpcdist.Executor(site="local-slurm", nodes=2, tasks_per_node=2, time_min=5, set=sets)
job = ex.submit(gather, "hi")
print(json.dumps({"id": job.job_id, "results": job.results(), "state": job.state.value}))
"""

ATTACH = """
import json, sys
import hpcdist
job = hpcdist.job(sys.argv[1])
print(json.dumps({"results": job.results(), "state": job.state.value, "name": job.record.name}))
"""


def python(code: str, *args: str, cwd: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_a_notebook_that_started_mpi_submits_a_job_whose_ranks_are_their_own(slurm_storage: Path,
                                                                              tmp_path: Path) -> None:
    """A process that imported mpi4py (a singleton MPI_Init: PMIX_RANK=0 and the rest in its C
    environment) submits a 2-node job: its tasks get srun's ranks, not the submitter's (before:
    every task was rank 0 and waited 60 s for ranks 1-3)."""
    script = tmp_path / "notebook.py"
    script.write_text("from mpi4py import MPI\nassert MPI.Is_initialized()\n" + MAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), json.dumps({**SLURM, **storage(slurm_storage)})],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["results"] == ["hi-0-10", "hi-1-10", "hi-2-10", "hi-3-10"]


def test_a_main_function_runs_by_value_and_a_new_process_reattaches(slurm_storage: Path, tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(MAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), json.dumps({**SLURM, **storage(slurm_storage)})],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["results"] == ["hi-0-10", "hi-1-10", "hi-2-10", "hi-3-10"]
    again = python(ATTACH, first["id"], cwd=tmp_path)  # another process, another folder
    assert again == {"results": first["results"], "state": "COMPLETED", "name": "gather"}


def test_map_array_is_one_job_array_of_a_job_per_item(slurm_storage: Path) -> None:
    ex = hpcdist.Executor(site="local-slurm", tasks_per_node=1, time_min=5, set={**SLURM, **storage(slurm_storage)})
    jobs = ex.map_array(square, [2, 3, 4], max_parallel=2)
    array = {j.job_id.split("_")[0] for j in jobs}
    assert len(array) == 1 and [j.job_id.split("_")[1] for j in jobs] == ["0", "1", "2"]
    assert [j.result() for j in jobs] == [4, 9, 16]
    assert [hpcdist.job(j.job_id).result() for j in jobs] == [4, 9, 16]


def test_a_rank_that_raises_is_named_by_result(slurm_storage: Path) -> None:
    ex = hpcdist.Executor(site="local-slurm", nodes=2, tasks_per_node=1, time_min=5,
                          set={**SLURM, **storage(slurm_storage)})
    job = ex.submit(fail_on_rank_one, "shard 7 is corrupt")
    with pytest.raises(hpcdist.JobFailed) as failed:
        job.result()
    message = str(failed.value)
    assert message.startswith(f"job {job.job_id} (fail_on_rank_one) ended FAILED: rank 1"), message
    assert "n2" in message and "ValueError: shard 7 is corrupt" in message, message
    assert "ValueError: shard 7 is corrupt" in failed.value.traceback
    assert [o.ok for o in failed.value.outcomes] == [True, False]


def test_the_rank_that_raised_is_named_first_not_the_ranks_whose_connections_broke(slurm_storage: Path) -> None:
    """Rank 2 raises while ranks 0, 1 and 3 wait in a barrier: ``result()`` and ``hpcdist wait``
    name rank 2's ValueError first, however srun saw the ranks end."""
    ex = hpcdist.Executor(site="local-slurm", nodes=2, tasks_per_node=2, time_min=5,
                          set={**SLURM, **storage(slurm_storage)})
    job = ex.submit(boom_on_rank_two)
    with pytest.raises(hpcdist.JobFailed) as failed:
        job.result()
    message = str(failed.value)
    assert message.startswith(f"job {job.job_id} (boom_on_rank_two) ended FAILED: rank 2"), message
    assert "rank 2 on n2: tests.test_executor:boom_on_rank_two raised ValueError: bad value 7" in message, message
    assert "went first" not in message or "rank 2 on n2 went first" in message, message
    assert "ValueError: bad value 7" in failed.value.traceback
    waited = run_cli("wait", job.job_id, "--site", "local-slurm")
    cause = next(line for line in waited.out.splitlines() if line.strip().startswith("cause:"))
    assert "rank 2 on n2 went first" in cause, waited.text


def test_a_return_value_that_cannot_travel_names_the_rank_and_type(tmp_path: Path) -> None:
    ex = hpcdist.Executor(site="local", tasks_per_node=1, time_min=5, set=storage(tmp_path))
    job = ex.submit(unpicklable)
    with pytest.raises(hpcdist.JobFailed) as failed:
        job.result(timeout_s=180)
    assert "rank 0" in str(failed.value) and "_thread.lock" in str(failed.value), str(failed.value)
    assert "cannot be pickled" in str(failed.value)


def test_map_array_items_own_their_state_hold_max_parallel_and_share_one_snapshot(tmp_path: Path) -> None:
    """On the local site: each item has its own checkpoint directory (none resumes another's state),
    at most `max_parallel` run at once, and the array takes one code snapshot."""
    ex = hpcdist.Executor(site="local", tasks_per_node=1, time_min=5, set=storage(tmp_path))
    jobs = ex.map_array(remember, [10, 20, 30], max_parallel=1)
    got = [j.result(timeout_s=240) for j in jobs]
    assert [g["found"] for g in got] == [False, False, False]
    assert [g["dir"] for g in got] == [str(tmp_path / "checkpoints" / f"remember-{i}") for i in range(3)]
    assert got[0]["end"] <= got[1]["start"] and got[1]["end"] <= got[2]["start"], got  # one at a time
    assert len(list((tmp_path / "logs" / "remember").glob("code-*"))) == 1


def test_a_job_index_that_cannot_be_written_warns_and_the_queued_job_is_returned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The state folder cannot be made (a file stands in its path): the job is queued all the
    same, so ``submit`` warns and returns its handle, which waits and returns its value."""
    (tmp_path / "state-file").write_text("")
    monkeypatch.setenv("HPCDIST_STATE", str(tmp_path / "state-file" / "hpcdist"))
    ex = hpcdist.Executor(site="local", tasks_per_node=1, time_min=5, set=storage(tmp_path))
    job = ex.submit(square, 7)
    assert f"hpcdist: warning: job {job.job_id} is submitted but not in the job index" in capsys.readouterr().err
    assert job.result(timeout_s=180) == 49


def test_init_arguments_in_a_function_are_honoured_or_refused_in_one_line(tmp_path: Path) -> None:
    """``hpcdist.init(checkpoint_dir=..., keep_last=None)`` inside the function sets its checkpoints
    as in a script; a name (set at submission) is refused, naming the executor's keyword."""
    ex = hpcdist.Executor(site="local", tasks_per_node=1, time_min=5, set=storage(tmp_path))
    mine = tmp_path / "mine"
    assert ex.submit(save_five, str(mine)).result(timeout_s=180) == [f"step_{n:08d}.h5" for n in range(1, 6)]
    assert not (tmp_path / "checkpoints" / "save_five").exists()
    with pytest.raises(hpcdist.JobFailed) as failed:
        ex.submit(rename_itself).result(timeout_s=180)
    assert ("ConfigError: hpcdist.init(name='other') in an Executor function: the job runs with name='rename_itself', "
            "set when it was submitted; pass it there: hpcdist.Executor(name='other')") in str(failed.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"nodes": 0}, "resources.nodes"),
    ({"gpus_per_node": 99}, "resources.gpus_per_node: 99 is not possible on site 'local-slurm'"),
    ({"colour": "red"}, "hpcdist.Executor: unknown argument colour='red'"),
    ({"set": {"env.A B": "x"}}, "env"),
    ({"set": {"site.launcher.kind": "pbs"}}, "launcher.kind"),
    ({"name": "../up"}, "name"),
    ({"spec": "no/such/spec.yaml"}, "spec='no/such/spec.yaml' does not exist"),
])
def test_bad_executor_arguments_are_one_error_before_anything_is_queued(
        kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as bad:
        hpcdist.Executor(site="local-slurm", **kwargs)
    assert message in str(bad.value) and "\n" not in str(bad.value).strip(), str(bad.value)


def test_import_hpcdist_stays_light() -> None:
    code = textwrap.dedent("""
        import sys, hpcdist
        hpcdist.Executor, hpcdist.JobState
        print(sorted(m for m in ("torch", "submitit", "cloudpickle") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.strip() == "[]"


def test_local_job_ids_are_not_confused_with_a_later_process(tmp_path: Path) -> None:
    """A local job's id is a reused process id: once its controller is gone, a new process with
    the same id does not make the old job RUNNING again."""
    from dataclasses import replace

    from hpcdist.login.jobhandle import JobHandle
    from hpcdist.login.jobindex import find

    ex = hpcdist.Executor(site="local", tasks_per_node=1, time_min=5, set=storage(tmp_path))
    job = ex.submit(square, 5)
    assert job.result(timeout_s=180) == 25
    record = find(job.job_id, "local")
    assert record.started is not None
    other = subprocess.Popen([sys.executable, "-m", "hpcdist.runtime.local_controller", "--help"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        impostor = replace(record, job_id=str(other.pid), ended=None)  # same id, another start time
        assert JobHandle(impostor).state is not hpcdist.JobState.RUNNING
    finally:
        other.kill()
        other.wait()

"""`hpcdist.init()` in the user's own code: checkpoints of any state, the directory claim, and
preemption on the real cluster (USR2, SIGTERM): the job checkpoints, requeues, resumes and ends
in the same state as an uninterrupted run."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcdist.api import Context, decode, encode
from hpcdist.errors import CheckpointError
from hpcdist.store import CheckpointStore
from hpcdist.store.checkpoint.claim import Claim, Holder, read
from hpcdist.store.results import read_attrs, read_table
from tests.support import train as fx
from tests.support.cli import REPO, require_slurm, run_cli, storage_sets
from tests.support.rankctx import rank_context
from tests.support.train import (
    Background,
    assert_completed_after_one_requeue,
    ckpt_dir,
    preempt_and_release,
    queue_state,
    train,
    wait_for,
)

train_root, tokens = fx.train_root, fx.tokens  # session fixtures: the token file, made once
API = REPO / "examples" / "ddp_hpcdist.py"
STEPS = 120


# ---------------------------------------------------------------- any state in a checkpoint


def test_model_optimizer_and_rng_state_round_trip(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
             "meta": {"epoch": 3, "tag": None, "pair": (1, 2.5), "names": ["a", "b"]}}
    store = CheckpointStore(tmp_path, keep_last=2)
    store.save(7, {"state": encode(state)})
    back = decode(store.load(7).tree["state"])
    assert back["meta"] == {"epoch": 3, "tag": None, "pair": (1, 2.5), "names": ["a", "b"]}
    assert torch.equal(back["rng"], state["rng"])
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    fresh.load_state_dict(back["opt"])
    assert fresh.state_dict()["param_groups"][0]["lr"] == 0.1
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def one_rank(tmp_path: Path) -> Context:
    """A single-rank Context with no process group (every collective is then a no-op)."""
    return rank_context(tmp_path, keep_last=2)


def test_background_saves_commit_in_order_and_a_tree_keeps_its_own_layout(tmp_path: Path) -> None:
    ctx = one_rank(tmp_path)
    ckpts = ctx.checkpoints
    for step in (1, 2, 3):
        ckpts.save(step, {"w": torch.full((4,), float(step))}, background=True)
    ckpts.wait()
    assert [s.path.name for s in ckpts.committed] == [f"step_{n:08d}.h5" for n in (1, 2, 3)]
    latest = ckpts.load_latest()
    assert latest is not None and latest[0] == 3 and torch.equal(latest[1]["w"], torch.full((4,), 3.0))
    assert ckpts.store.steps() == [2, 3]  # keep_last=2
    path = ckpts.save_tree(4, {"model": {"w": np.arange(3.0)}}, epoch=1, attrs={"note": "x"})
    read_back = CheckpointStore(ckpts.directory).load(4)
    assert path == read_back.path and read_back.epoch == 1 and read_back.attrs["note"] == "x"
    assert np.array_equal(read_back.tree["model"]["w"], np.arange(3.0))  # at the root, as written
    ctx.close()
    assert read(ckpts.directory) is None


def slow_background_writes(monkeypatch: pytest.MonkeyPatch, fault: str = "") -> None:
    """The checkpoint thread's writes take 1 s (and then fail with a full disk, with `fault`)."""
    import errno
    import threading

    from hpcdist.store.checkpoint import single as module

    write = module.write_tree

    def slow(*args: object, **kwargs: object) -> object:
        if threading.current_thread().name.startswith("hpcdist-checkpoint"):
            time.sleep(1.0)
            if fault:
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "write_tree", slow)


@pytest.mark.parametrize("leave", ["requeue", "release"])
def test_requeue_and_release_wait_for_the_background_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          leave: str) -> None:
    from hpcdist.runtime.requeue import Requeued

    slow_background_writes(monkeypatch)
    ctx = one_rank(tmp_path)
    ctx._requeue = lambda: ""  # as submitit's requeue, which returns before Slurm's kill
    ckpts = ctx.checkpoints
    ckpts.save(5, {"w": torch.ones(4)}, background=True)
    if leave == "requeue":
        with pytest.raises(Requeued):
            ctx.requeue()
    else:
        ctx.release()
        assert read(ckpts.directory) is None  # the claim is dropped, after the write
    assert ckpts.store.latest() == ckpts.store.path(5)  # committed before the job could be killed


def test_requeue_reports_a_background_save_that_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_background_writes(monkeypatch, fault="full disk")
    ctx = rank_context(tmp_path, requeue=lambda: "")
    ctx.checkpoints.save(5, {"w": torch.ones(4)}, background=True)
    ctx.results.attrs["loss"] = 1.0
    with pytest.raises(CheckpointError, match="step_00000005.h5 failed: no space left on the device"):
        ctx.requeue()
    assert read_attrs(ctx.results.path)["complete"] is False
    assert ctx.checkpoints.store.latest() is None


def test_each_run_of_a_script_outside_a_job_has_its_own_result_file(tmp_path: Path) -> None:
    """No launcher, no job id: two runs of the same script write two result files, each named in
    the run's log; neither replaces the other."""
    script = tmp_path / "mine.py"
    script.write_text("import sys, hpcdist\nctx = hpcdist.init()\nctx.results.attrs['run'] = int(sys.argv[1])\n"
                      "ctx.close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_", "OMPI_",
                                                                     "PMI", "RANK", "WORLD_SIZE", "HPCDIST_SITE"))}
    env["PYTHONPATH"] = str(REPO)
    runs = [subprocess.Popen([sys.executable, str(script), str(n)], cwd=tmp_path, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (1, 2)]
    logs = [run.communicate(timeout=120)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], logs
    files = sorted((tmp_path / "hpcdist-out" / "results" / "mine").glob("*.h5"))
    assert len(files) == 2, (files, logs)
    assert sorted(read_attrs(f)["run"] for f in files) == [1, 2]
    for f in files:  # each run's log says where its results are (the local site's storage, under the cwd)
        assert f.name.startswith("local-") and sum(f"results in {f}" in log for log in logs) == 1, logs


def test_a_restart_after_a_node_failure_is_not_counted_as_a_time_out(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's restart count 1: with no record of why, a time-out (the bound never lifts); the
    job's node failure record saying run 1 ended by a node death, none."""
    from hpcdist.runtime.requeue import Requeues
    from hpcdist.store.records import node_failures

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert rank_context(tmp_path / "a", job_id="77").requeue_count == Requeues(1, 1)
    record = tmp_path / "b" / "results" / "t" / "77.node_failures.json"
    node_failures.add(record, [node_failures.NodeFailure("n3", "2026-11-25T10:00:00", 1, time.time())])
    ctx = rank_context(tmp_path / "b", job_id="77")
    assert ctx.job.paths.node_failures == record and ctx.requeue_count == Requeues(0, 0)


def _plain_env() -> dict[str, str]:
    """This process's environment without any launcher's or site's variables: a run outside any job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_", "OMPI_",
                                                                     "PMI", "RANK", "WORLD_SIZE", "HPCDIST_SITE"))}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_init_under_python_c_stdin_and_the_prompt_names_how_it_was_started(tmp_path: Path) -> None:
    """``python -c``, a script on stdin (``python -`` or ``python < f``), the interactive prompt:
    each run gets a valid name saying how it was started, its results under that name; a bad name
    passed to ``init`` is one line."""
    code = "import hpcdist; ctx = hpcdist.init(); ctx.results.attrs['ok'] = 1; ctx.close()\n"
    runs = {
        "python-c": subprocess.run([sys.executable, "-c", code], input="", **_run_opts(tmp_path)),
        "python-stdin": subprocess.run([sys.executable, "-"], input=code, **_run_opts(tmp_path)),
        "python-interactive": subprocess.run([sys.executable, "-i"], input=code, **_run_opts(tmp_path)),
    }
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.stderr)
        files = list((tmp_path / "hpcdist-out" / "results" / name).glob("local-*.h5"))
        assert len(files) == 1 and read_attrs(files[0])["ok"] == 1, (name, run.stderr)
    bad = subprocess.run([sys.executable, "-c", "import hpcdist; hpcdist.init(name='my run')"], **_run_opts(tmp_path))
    assert bad.returncode == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("hpcdist.errors.ConfigError: hpcdist.init: name: the job name becomes a folder"), bad.stderr
    assert "(got 'my run')" in last and "pydantic" not in bad.stderr, bad.stderr


def _run_opts(cwd: Path) -> dict[str, object]:
    return {"cwd": cwd, "env": _plain_env(), "text": True, "capture_output": True, "timeout": 120}


def test_tensors_given_to_results_are_written_as_numbers(tmp_path: Path) -> None:
    """A script hands ctx.results what it has: a loss that still requires grad, bfloat16 figures, a
    tensor column (on a GPU, a CUDA tensor: the same conversion to the host, checked by gpu-check).
    np.asarray refused each of them at close(), after the whole run."""
    script = tmp_path / "figs.py"
    script.write_text(
        "import torch, hpcdist\nctx = hpcdist.init()\nw = torch.ones(2, requires_grad=True)\n"
        "ctx.results.attrs['loss'] = (w * 1.5).sum()\n"
        "ctx.results.attrs['lr'] = torch.tensor(0.25, dtype=torch.bfloat16)\n"
        "ctx.results.table('steps', {'loss': [w.sum(), w.sum() * 2], 'tokens': torch.arange(2)})\nctx.close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_", "OMPI_",
                                                                     "PMI", "RANK", "WORLD_SIZE", "HPCDIST_SITE"))}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True, capture_output=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = (tmp_path / "hpcdist-out" / "results" / "figs").glob("*.h5")
    attrs = read_attrs(path)
    assert (attrs["loss"], attrs["lr"]) == (3.0, 0.25)
    import h5py

    with h5py.File(path) as f:
        steps = read_table(f["steps"])
    assert list(steps["loss"]) == [2.0, 4.0] and list(steps["tokens"]) == [0, 1]


# ---------------------------------------------------------------- the directory claim


def test_a_second_writer_fails_naming_the_holder(tmp_path: Path) -> None:
    first = Claim(tmp_path, Holder("local-1", socket.gethostname(), os.getpid(), time.time())).acquire()
    with pytest.raises(CheckpointError, match=r"claimed by job local-1 on .* which is still running.*another job name"):
        Claim(tmp_path, Holder("local-2", socket.gethostname(), os.getpid(), time.time())).acquire()
    first.release()
    assert read(tmp_path) is None
    Claim(tmp_path, Holder("local-2", socket.gethostname(), os.getpid(), time.time())).acquire()


def test_a_stale_claim_is_taken_over_and_a_requeue_takes_its_own_back(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    Claim(tmp_path, Holder("local-9", socket.gethostname(), dead.pid, time.time() - 60)).acquire()
    mine = Claim(tmp_path, Holder("local-10", socket.gethostname(), os.getpid(), time.time())).acquire()
    assert mine.took_over is not None and mine.took_over.job_id == "local-9"
    # A requeue of the same job (a higher restart count) on another pid and host takes it back at once.
    again = Claim(tmp_path, Holder("local-10", "other-host", 1, time.time(), restarts=1)).acquire()
    assert read(tmp_path) == again.holder and again.took_over is None


@pytest.mark.slurm
def test_a_claim_of_an_ended_slurm_job_is_stale(tmp_path: Path) -> None:
    require_slurm()
    ended = subprocess.run(["sbatch", "--parsable", "-p", "cpu", "-o", "/dev/null", "--wrap", "true"],
                           capture_output=True, text=True, check=True).stdout.strip()
    wait_for(lambda: queue_state(ended) == "", 60, f"job {ended} to end")
    Claim(tmp_path, Holder(ended, "n1", 1, time.time())).acquire()
    mine = Claim(tmp_path, Holder("local-1", socket.gethostname(), os.getpid(), time.time())).acquire()
    assert mine.took_over is not None and mine.took_over.job_id == ended


def test_a_second_job_on_the_same_checkpoints_fails_at_once(tmp_path: Path, cpu_burner: int) -> None:
    """On a loaded machine (two busy processes per CPU), as in a suite run beside other work."""
    root = tmp_path / "out"
    args = ["submit", "--site", "local", *storage_sets(root), "--wait", "--set", "timeout_s=30", "--"]
    first = Background([*args, str(API), "--steps", "400", "--step-s", "0.05"])
    try:
        wait_for(lambda: (root / "checkpoints" / "ddp_hpcdist" / ".claim").is_file(), 90, "the first job's claim")
        holder = read(root / "checkpoints" / "ddp_hpcdist")
        assert holder is not None
        second = run_cli(*args, str(API), "--steps", "5")
    finally:
        first.kill()
    assert second.code == 1, second.text
    assert re.search(rf"rank 0: FAILED JobError: rank 0 on \S+: ddp_hpcdist.py raised CheckpointError: checkpoint "
                     rf"directory \S+ is claimed by job {holder.job_id} on", second.out), second.out


# ---------------------------------------------------------------- preemption on the cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The uninterrupted run's final model (2 ranks on the local site)."""
    root = tmp_path_factory.mktemp("ref")
    result = run_cli("submit", "--site", "local", "--set", "resources.tasks_per_node=2", *storage_sets(root),
                     "--wait", "--", str(API), "--steps", str(STEPS))
    assert result.code == 0, result.text
    return final_model(root)


def final_model(root: Path) -> dict[str, np.ndarray]:
    from hpcdist.store.sharded import checkpoint as sharded  # 2 ranks: the model is saved sharded, each tensor once

    path = CheckpointStore(root / "checkpoints" / "ddp_hpcdist").path(STEPS)
    return {k: v.numpy() for k, v in sharded.read_full(path)["model"].items()}


@pytest.mark.slurm
@pytest.mark.parametrize("sig", ["USR2", "TERM"])
def test_preempted_api_job_requeues_and_ends_as_uninterrupted(slurm_storage: Path, reference: dict[str, np.ndarray],
                                                              sig: str) -> None:
    root = slurm_storage
    job = Background(["submit", "--site", "local-slurm", "--set", "resources.nodes=2", *storage_sets(root),
                      "--wait", "--", str(API), "--steps", str(STEPS), "--step-s", "0.05"])
    try:
        ckpts = root / "checkpoints" / "ddp_hpcdist"
        wait_for(lambda: (ckpts / "step_00000020.h5").is_file(), 150, "the first checkpoint")
        jid = next(p.name for p in (root / "logs" / "ddp_hpcdist").iterdir() if p.name.isdigit())
        preempt_and_release(jid, sig)
        result = job.finish(timeout=240)
    finally:
        job.kill()
    assert_completed_after_one_requeue(jid, result, ranks=2)
    log = (root / "logs" / "ddp_hpcdist" / jid / f"{jid}_0_log.err").read_text()
    stopped = int(re.search(r"stop requested: checkpointing at step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert 20 <= stopped < STEPS and f"resumed from step {stopped}" in log
    noted = (root / "logs" / "ddp_hpcdist" / jid / "requeues.txt").read_text()  # no node death, whatever the nodes
    assert noted.startswith("run 1 requeued: asked by the job") and noted.count("\n") == 1, noted
    model = final_model(root)
    assert all(np.array_equal(model[k], reference[k]) for k in reference), "the resumed run ended elsewhere"
    path = root / "results" / "ddp_hpcdist" / f"{jid}.h5"
    attrs = read_attrs(path)
    assert attrs["complete"] and attrs["resumed_from"] == stopped and attrs["site"] == "local-slurm"
    import h5py

    with h5py.File(path) as f:
        assert read_table(f["loss"])["step"].tolist() == list(range(1, STEPS + 1))
    assert read(ckpts) is None  # the claim was released at the end


def test_train_gpt_refuses_a_checkpoint_directory_another_job_holds(train_root: Path, tokens: Path) -> None:
    root = train_root / "claimed"
    held = Claim(ckpt_dir(root), Holder("local-other", socket.gethostname(), os.getpid(), time.time())).acquire()
    try:
        result = train(root, tokens, "--set", "params.steps=2", "--set", "params.optim.warmup_steps=1")
    finally:
        held.release()
    assert result.code == 1, result.text
    assert re.search(r"rank 0: FAILED CheckpointError: checkpoint directory \S+ is claimed by job local-other on",
                     result.out), result.out
    assert not list(ckpt_dir(root).glob("step_*"))

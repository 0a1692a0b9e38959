"""Experiment trackers, as a user meets them: one run per job across preemptions and requeues.

A real MLflow tracking server (``mlflow server``, SQLite backend) started here on the address the
cluster's nodes reach (the host's end of the test bridge; loopback in single-host mode), and
TensorBoard's own reader on the event files. `train_gpt` on the Slurm cluster, preempted and
requeued twice, is one MLflow run and one TensorBoard run with each step once, equal to the
HDF5 result; an unchanged script that calls ``mlflow.start_run()`` continues its run after a
requeue; a server stopped mid-run costs the job one warning and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hpcdist.store.results import read_attrs, read_table
from tests.netfault import cluster_mode
from tests.support import train as fx
from tests.support import wandb_log
from tests.support.cli import require_slurm, result_path, run_cli, storage_sets
from tests.support.train import (
    STEPS,
    TWO_NODES,
    Background,
    preempt_and_release,
    preempted_once,
    rank_log,
    slurm_job,
    train_args,
    wait_for,
)

train_root, tokens = fx.train_root, fx.tokens
MLFLOW = Path(sys.executable).with_name("mlflow")
PLAIN_MLFLOW = Path(__file__).parent / "scripts" / "mlflow_plain.py"


@dataclass
class Server:
    uri: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its gunicorn worker: a group of its own
            self.proc.wait(timeout=20)


def host_address() -> str:
    """Where the cluster's nodes reach this machine: the host's end of the test bridge (the address
    this machine sends from towards node n1), or loopback when the nodes share this machine's."""
    if not cluster_mode().startswith("netns"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.251.0.11", 9))  # cluster/lib.sh's n1; UDP connect sends nothing
        return str(s.getsockname()[0])


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_mlflow(folder: Path, host: str = "127.0.0.1") -> Server:
    """`mlflow server` with a SQLite backend on `host`, its artifacts under `folder`, up within 60 s."""
    import urllib.request

    folder.mkdir(parents=True, exist_ok=True)
    port = free_port(host)
    log = folder / "server.log"
    proc = subprocess.Popen(
        [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
         "--artifacts-destination", str(folder / "artifacts"), "--host", host, "--port", str(port),
         "--workers", "1", "--gunicorn-opts", "--log-level warning"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
    uri = f"http://{host}:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"mlflow server ended: {log.read_text()[-2000:]}")
        try:
            return urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200
        except OSError:
            return False

    server = Server(uri, proc, log)
    try:
        wait_for(up, 60, f"mlflow server on {uri}", poll=0.3)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_mlflow(tmp_path_factory.mktemp("mlflow"), host_address())
    yield server
    server.stop()


def result_steps(result: Path) -> dict[str, np.ndarray]:
    import h5py

    with h5py.File(result, "r") as f:
        return read_table(f["train/steps"])


def runs_of(uri: str, experiment: str) -> list:  # type: ignore[type-arg]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def history(uri: str, run_id: str, key: str) -> tuple[list[int], list[float]]:
    from mlflow.tracking import MlflowClient

    points = sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [m.step for m in points], [m.value for m in points]


def tensorboard_scalars(folder: Path, tag: str) -> tuple[list[int], list[float]]:
    """The scalars TensorBoard itself shows for `tag`: its EventAccumulator over the run's folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars(tag)
    return [e.step for e in events], [e.value for e in events]


def read_key(folder: Path) -> str:
    """The run's id that the job's identity file holds (its W&B run id)."""
    return str(json.loads((folder / "run.json").read_text())["key"])


def tracking_sets(uri: str, experiment: str) -> list[str]:
    return ["--set", f"tracking={{mlflow: {{uri: '{uri}', experiment: {experiment}}}, tensorboard: true}}"]


# ---------------------------------------------------------------- train_gpt, preempted twice


@pytest.mark.slurm
def test_train_gpt_preempted_twice_is_one_run_with_each_step_once(train_root: Path, tokens: Path,
                                                                  mlflow_server: Server) -> None:
    require_slurm()
    root = train_root / "tracked"
    job = Background(train_args(root, tokens, *TWO_NODES, *tracking_sets(mlflow_server.uri, "preempted"),
                                "--set", "tracking.wandb={project: preempted, mode: offline}", site="local-slurm"))
    try:
        wait_for(lambda: "step 20/400" in rank_log(root), 120, "step 20 in rank 0's log")
        jid = slurm_job(root)
        preempt_and_release(jid, "USR2")
        wait_for(lambda: "/400" in rank_log(root).partition("resumed from")[2], 120, "the first restart's steps")
        preempt_and_release(jid, "USR2")
        result = job.finish(timeout=180)
    finally:
        job.kill()
    assert result.code == 0, result.text
    attrs = read_attrs(result_path(result.out))
    assert attrs["requeues"] == 2 and attrs["final_step"] == STEPS
    steps = result_steps(result_path(result.out))
    assert list(steps["step"]) == list(range(1, STEPS + 1))

    runs = runs_of(mlflow_server.uri, "preempted")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["hpcdist.job_id"] == jid
    assert run.data.params["params.steps"] == str(STEPS) and run.data.params["hpcdist.kind"] == "train_gpt"
    for key in ("loss", "grad_norm", "lr"):
        logged, values = history(mlflow_server.uri, run.info.run_id, key)
        assert logged == list(range(1, STEPS + 1)), f"{key}: steps logged twice or missing"
        assert values == [float(v) for v in steps[key]], key
    logged, _ = history(mlflow_server.uri, run.info.run_id, "val_loss")
    assert logged == [100, 200, 300, 400]
    from mlflow.tracking import MlflowClient

    client, result_file = MlflowClient(mlflow_server.uri), result_path(result.out)
    plot = f"train_gpt_{result_file.stem}_loss.png"  # the plot `hpcdist report --plot` makes
    artifacts = sorted(a.path for a in client.list_artifacts(run.info.run_id))
    assert artifacts == sorted([result_file.name, plot])
    assert Path(client.download_artifacts(run.info.run_id, plot, str(root))).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    spec, site = (json.loads(run.data.tags[f"hpcdist.{k}_json"]) for k in ("spec", "site"))  # whole, as JSON
    assert spec["params"]["steps"] == STEPS and spec["resources"]["nodes"] == 2 and site["name"] == "local-slurm"

    folder = root / "logs" / "train_gpt" / "tracking"
    logged, values = tensorboard_scalars(folder / "tensorboard", "loss")
    assert logged == list(range(1, STEPS + 1))
    assert values == [float(np.float32(v)) for v in steps["loss"]]

    # W&B offline: one run id; each start's offline folder continues where the last one stopped
    starts = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(starts) == 3 and set().union(*(wandb_log.run_ids(f) for f in starts)) == {read_key(folder)}
    rows = [row for f in starts for row in wandb_log.history(f)]
    assert [row["_step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["loss"] for row in rows] == [float(v) for v in steps["loss"]]


# ---------------------------------------------------------------- an older checkpoint; a server that goes away


def test_a_resubmission_from_an_older_checkpoint_replaces_its_steps_and_survives_the_server_stopping(
        train_root: Path, tokens: Path, tmp_path: Path) -> None:
    """A local run stops at step 70 (`run_steps`); its step-70 checkpoint is lost, so the same spec
    submitted again resumes at step 50 into the same run and logs 51..70 a second time: TensorBoard
    drops the first ones (purge_step), MLflow keeps both and tags the run, W&B keeps the first.
    Then the MLflow server stops: the job completes, one warning in its log, every step in its
    result file."""
    server = start_mlflow(tmp_path / "mlflow")
    root = train_root / "older"
    args = train_args(root, tokens, *tracking_sets(server.uri, "older"), "--set", "tracking.wandb={project: older}",
                      "--set", "resources.tasks_per_node=1")  # one rank: two starts on a loaded machine
    try:
        first = run_cli(*args, "--set", "params.run_steps=70", timeout=180)
        assert first.code == 0 and "run_steps=70 reached" in first.out, first.text
        (root / "checkpoints" / "train_gpt" / "step_00000070.h5").unlink()
        job = Background(args)
        try:
            [run] = runs_of(server.uri, "older")
            wait_for(lambda: max(history(server.uri, run.info.run_id, "loss")[0]) >= 75, 120,
                     "the second job's step 75 in MLflow")
            logged, _ = history(server.uri, run.info.run_id, "loss")
            assert sorted(set(logged)) == list(range(1, max(logged) + 1))
            assert [s for s in logged if logged.count(s) > 1] == [s for s in range(51, 71) for _ in (0, 1)]
            [tag] = [v for k, v in runs_of(server.uri, "older")[0].data.tags.items()
                     if k.startswith("hpcdist.replayed_steps.")]
            assert tag == "51-70 (logged again after a restart from an older checkpoint)"
            server.stop()
            result = job.finish(timeout=120)
        finally:
            job.kill()
    finally:
        server.stop()
    assert result.code == 0, result.text
    log = rank_log(root)
    assert f"resumed from {root / 'checkpoints' / 'train_gpt' / 'step_00000050.h5'}: step 50" in log
    assert len(re.findall(r"tracking: mlflow is not taking metrics", log)) == 1, log[-3000:]
    steps = result_steps(result_path(result.out))
    assert list(steps["step"]) == list(range(1, STEPS + 1))

    folder = root / "logs" / "train_gpt" / "tracking"
    logged, values = tensorboard_scalars(folder / "tensorboard", "loss")
    assert logged == list(range(1, STEPS + 1)) and values == [float(np.float32(v)) for v in steps["loss"]]
    starts = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = [row for f in starts for row in wandb_log.history(f)]
    assert len(starts) == 2 and [row["_step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["loss"] for row in rows[70:]] == [float(v) for v in steps["loss"][70:]]


def test_naming_a_tracker_that_is_not_installed_is_one_error_at_submit(tmp_path: Path) -> None:
    """W&B taken out of the submitting Python (``sys.modules["wandb"] = None``: the dev extra installs
    it, and a second virtual environment without it would cost the suite a minute)."""
    hide = ("import sys; sys.modules['wandb'] = None; from hpcdist.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", hide, "submit", "jobs/smoke.yaml", "--site", "local",
                           *storage_sets(tmp_path), "--set", "tracking.wandb.project=p"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode != 0
    assert "tracking names wandb, not installed in this Python: pip install 'hpcdist[wandb]'" in proc.stderr, proc
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "logs" / "smoke").exists()


@pytest.mark.slurm
def test_an_unchanged_script_continues_its_mlflow_run_after_a_requeue(train_root: Path,
                                                                     mlflow_server: Server) -> None:
    """`mlflow.start_run()` with no argument, in a script with no hpcdist call: the job's environment
    names its run, so after Slurm requeues the job the script logs on into the same run."""
    require_slurm()
    root = train_root / "plain-script"
    state = root / "state.txt"
    jid, result = preempted_once(
        ["submit", "--site", "local-slurm", "--wait", *storage_sets(root),
         "--set", f"tracking.mlflow={{uri: '{mlflow_server.uri}', experiment: plain}}",
         "--", str(PLAIN_MLFLOW), str(state), "60"], root, "mlflow_plain",
        lambda: state.exists() and int(state.read_text() or 0) >= 10, "step 10 of the script", "requeue", finish_s=120)
    assert result.code == 0, result.text
    out = "".join(p.read_text() for p in (root / "logs" / "mlflow_plain" / jid).glob("*_log.out"))
    started = re.findall(r"mlflow run (\w+) from step (\d+)", out)
    runs = runs_of(mlflow_server.uri, "plain")
    assert len(runs) == 1 and len(started) == 2, out
    assert {run_id for run_id, _ in started} == {runs[0].info.run_id} and started[1][1] != "0"
    logged, values = history(mlflow_server.uri, runs[0].info.run_id, "x")
    assert logged == list(range(60)) and values == [s * 0.5 for s in range(60)]


def test_steps_a_killed_start_never_sent_reach_tensorboard_from_the_checkpoint(train_root: Path, tokens: Path) -> None:
    """A start whose rank 0 was killed before its tracker thread sent anything (issue 64's chaos
    soak: rank 0 SIGKILLed at step 18, within the thread's first second) leaves no event file and
    no high-water mark, though its checkpoints hold the steps. Made here by removing what the
    first start sent: the next start resumes at step 30 and TensorBoard shows every step once."""
    root = train_root / "unsent"
    args = train_args(root, tokens, "--set", "tracking={tensorboard: true}", "--set", "resources.tasks_per_node=1")
    first = run_cli(*args, "--set", "params.run_steps=30", timeout=180)
    assert first.code == 0 and "run_steps=30 reached" in first.out, first.text
    folder = root / "logs" / "train_gpt" / "tracking"
    for sent in [*(folder / "tensorboard").iterdir(), folder / "steps.json"]:
        sent.unlink()
    again = run_cli(*args, timeout=180)
    assert again.code == 0, again.text
    assert "resumed from" in rank_log(root) and ": step 30," in rank_log(root), rank_log(root)[-2000:]
    steps = result_steps(result_path(again.out))
    logged, values = tensorboard_scalars(folder / "tensorboard", "loss")
    assert logged == list(range(1, STEPS + 1)) and values == [float(np.float32(v)) for v in steps["loss"]]

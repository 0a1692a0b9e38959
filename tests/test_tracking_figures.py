"""Figures of the benchmark and inference jobs reach a tracker (TensorBoard: its own reader on the
event files, no server): each bench row's bandwidth at its row number, and inference's latency
percentiles and throughput, equal to what the job's HDF5 result holds; and `hpcdist track sync` of
a job that names no W&B."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import torch

from hpcdist.data.tokenizer import BYTES
from hpcdist.model.checkpoint import write_checkpoint
from hpcdist.model.gpt import GPT, GPTConfig
from tests.support.cli import job_id, result_path, run_cli, storage_sets
from tests.support.train import Background
from tests.test_tracking import tensorboard_scalars

BENCH = ["--set", "resources.nodes=1", "--set", "resources.tasks_per_node=2", "--set", "params.paths=[torch]",
         "--set", "params.ops=[all_reduce]", "--set", "params.modes=[in_place]", "--set", "params.min_bytes=8",
         "--set", "params.max_bytes=512", "--set", "params.factor=8", "--set", "params.warmup=1",
         "--set", "params.iters=2"]


def test_bench_rows_and_infer_figures_reach_tensorboard(tmp_path: Path) -> None:
    cfg = GPTConfig(vocab_size=257, context=32, n_layer=1, n_head=2, d_model=32)
    torch.manual_seed(0)
    checkpoint = write_checkpoint(tmp_path / "model", 1, GPT(cfg).state_dict(), cfg, tokenizer=BYTES)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe cluster\n")
    tensorboard = ["--set", "tracking.tensorboard=true"]
    bench = Background(["submit", "jobs/bench_collectives.yaml", "--site", "local", "--wait",
                        *storage_sets(tmp_path / "bench"), *tensorboard, *BENCH])
    infer = Background(["submit", "jobs/infer_gpt.yaml", "--site", "local", "--wait",
                        *storage_sets(tmp_path / "infer"), *tensorboard, "--set", f"params.checkpoint={checkpoint}",
                        "--set", f"params.prompts={prompts}", "--set", "params.tp=1",
                        "--set", "resources.tasks_per_node=1", "--set", "params.max_new_tokens=4"])
    try:
        ran = {"bench": bench.finish(timeout=120), "infer": infer.finish(timeout=120)}
    finally:
        bench.kill()
        infer.kill()
    for what, run in ran.items():
        assert run.code == 0, (what, run.text)

    with h5py.File(result_path(ran["bench"].out), "r") as f:
        rows = {k: v[()] for k, v in f["bench/all_reduce/torch"].items()}
    folder = tmp_path / "bench" / "logs" / "bench-collectives" / "tracking" / "tensorboard"
    steps, busbw = tensorboard_scalars(folder, "bench/all_reduce/torch/busbw_gbps")
    assert steps == [1, 2, 3] and list(rows["size"]) == [8, 64, 512]  # each row at its number in the job
    assert busbw == [float(v) for v in rows["busbw_gbps"].astype("float32")]
    assert json.loads(tensorboard_text(folder, "hpcdist.spec_json"))["kind"] == "bench_collectives"

    with h5py.File(result_path(ran["infer"].out), "r") as f:
        summary = dict(f["summary"].attrs)
    folder = tmp_path / "infer" / "logs" / "infer_gpt" / "tracking" / "tensorboard"
    for tag in ("tokens_per_s", "ttft_p50_s", "total_p99_s"):
        assert tensorboard_scalars(folder, tag)[1] == [float(np.float32(summary[tag]))], tag
    assert json.loads(tensorboard_text(folder, "hpcdist.site_json"))["name"] == "local"


def tensorboard_text(folder: Path, tag: str) -> str:
    """The text TensorBoard shows under `tag` (the job's spec or site as JSON), its code fence taken off."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode().strip().removeprefix("```").removesuffix("```")


def test_track_sync_of_a_job_without_wandb_is_one_line(tmp_path: Path) -> None:
    """A job that names no W&B has nothing to sync: one line saying so, no traceback."""
    submitted = run_cli("submit", "jobs/smoke.yaml", "--site", "local", "--wait", *storage_sets(tmp_path),
                        "--set", "tracking.tensorboard=true")
    assert submitted.code == 0, submitted.text
    sync = run_cli("track", "sync", job_id(submitted.out), "--site", "local", "--print")
    assert sync.code == 2 and len(sync.err.strip().splitlines()) == 1, sync.text
    assert "no W&B run here" in sync.err and "tracking.wandb" in sync.err, sync.err

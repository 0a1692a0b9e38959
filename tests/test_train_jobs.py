"""train_gpt as a user submits it. On the local site: a resumed run equals an uninterrupted one
(after a stop, after a corrupt checkpoint, after a real preemption signal and requeue), time-outs
are bounded, unusable or foreign checkpoints stop the job with a clear error, and gradient
accumulation gives the update of one large batch. On the real local Slurm cluster (2 nodes):
`scancel --signal=USR2` mid-run, the job checkpoints, requeues itself through submitit
(`scontrol requeue`), comes back, resumes, and ends bit-identical to the uninterrupted run.

The token file and the uninterrupted reference run are made once per session (tests.support.train)."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdist import store
from hpcdist.store.results import read_attrs, read_table
from tests.support import train as fx
from tests.support.cli import rank_pids, require_slurm, result_path
from tests.support.train import (
    STEPS,
    Background,
    assert_completed_after_one_requeue,
    ckpt_dir,
    differing,
    final_checkpoint,
    model_arrays,
    preempted_slurm_run,
    rank_log,
    train,
    train_args,
    wait_for,
)

# The session fixtures: the token file and the uninterrupted reference run, made once.
train_root, tokens, reference = fx.train_root, fx.tokens, fx.reference


def flip_byte(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        b = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([b[0] ^ 0xFF]))


def initial_weights(tokens: Path) -> dict[str, np.ndarray]:
    """The /model tensors train_gpt starts from (TINY's shape, the default seed), as stored."""
    import torch

    from hpcdist.data.tokens import describe
    from hpcdist.model.checkpoint import model_tree
    from hpcdist.model.gpt import GPT, GPTConfig

    torch.manual_seed(1234)
    model = GPT(GPTConfig(vocab_size=describe(tokens).vocab_size, n_layer=1, n_head=2, d_model=32, context=32))
    return {k: v for k, v in model_tree(model.state_dict()).items() if isinstance(v, np.ndarray)}


def test_auto_precision_trains_in_fp32_on_cpus_and_the_result_says_so(train_root: Path, reference: Path) -> None:
    """jobs/train_gpt.yaml asks for `precision: auto`; on CPUs that is fp32 (bf16 autocast is slower there)."""
    (path,) = sorted((train_root / "reference" / "results").rglob("*.h5"))
    attrs = read_attrs(path)
    assert (attrs["precision_requested"], attrs["precision"]) == ("auto", "fp32")
    assert ", fp32" in rank_log(train_root / "reference")


def test_stop_then_resume_past_a_corrupt_checkpoint_equals_uninterrupted(train_root: Path, tokens: Path,
                                                                          reference: Path) -> None:
    root = train_root / "stop-corrupt"
    first = train(root, tokens, "--set", "params.run_steps=100")
    assert first.code == 0, first.text
    assert '"step": 100, "complete": false' in first.out and "run_steps=100 reached" in first.out
    newest = ckpt_dir(root) / "step_00000100.h5"
    flip_byte(newest, "model/transformer.h.0.attn.c_attn.weight")
    second = train(root, tokens)
    assert second.code == 0, second.text
    log = rank_log(root)
    assert (f"skipping checkpoint {newest}: dataset /model/transformer.h.0.attn.c_attn.weight fails its xxh3-128 check"
            in log)
    assert f"resumed from {ckpt_dir(root) / 'step_00000050.h5'}: step 50" in log
    assert differing(final_checkpoint(root), reference) == []


def test_preemption_signal_requeues_and_resumes_bit_for_bit(train_root: Path, tokens: Path, reference: Path) -> None:
    """USR2 reaches rank 1 only: the ranks agree at a step boundary, checkpoint, and submitit's
    local controller restarts them (exit code 144), which resume from that checkpoint."""
    root = train_root / "signal"
    job = Background(train_args(root, tokens))
    try:
        wait_for(lambda: "step 20/400" in rank_log(root), 120, "step 20 in rank 0's log")
        pids = wait_for(lambda: (p := rank_pids(str(root))) and len(p) == 2 and p, 10, "both rank processes")
        os.kill(pids[1], signal.SIGUSR2)
        result = job.finish(timeout=180)
    finally:
        job.kill()
    assert result.code == 0, result.text
    assert "2/2 ranks succeeded" in result.out and '"requeues": 1' in result.out
    log0 = rank_log(root, 0)
    stopped = int(log0.split("USR2 signal received: checkpointing at step ")[1].split()[0])
    assert 20 <= stopped < STEPS
    assert "requeueing job" in log0 and f"step_{stopped:08d}.h5: step {stopped}" in log0
    assert log0.count("starting fresh") == 1  # the second start resumed
    assert differing(final_checkpoint(root), reference) == []
    attrs = read_attrs(result_path(result.out))
    assert attrs["complete"] and attrs["requeues"] == 1 and attrs["final_step"] == STEPS
    with h5py.File(result_path(result.out)) as f:
        steps = read_table(f["train/steps"])
        io = read_table(f["train/checkpoints"])
    assert steps["step"].tolist() == list(range(1, STEPS + 1))  # metrics survive the requeue
    assert np.isfinite(steps["loss"]).all() and (steps["tokens_per_s"] > 0).all()
    assert {"write", "read"} <= set(io["op"].tolist()) and (io["mb_per_s"] > 0).all()


def test_time_outs_beyond_max_requeues_stop_with_a_committed_checkpoint(train_root: Path, tokens: Path) -> None:
    """With a 1-minute limit any signal is a time-out; max_requeues=0 allows none."""
    root = train_root / "timeouts"
    job = Background(train_args(root, tokens, "--set", "site.preemption.max_requeues=0",
                                "--set", "resources.time_min=1"))
    try:
        wait_for(lambda: "step 20/400" in rank_log(root), 120, "step 20 in rank 0's log")
        for pid in wait_for(lambda: (p := rank_pids(str(root))) and len(p) == 2 and p, 10, "both ranks").values():
            os.kill(pid, signal.SIGUSR2)
        result = job.finish(timeout=120)
    finally:
        job.kill()
    assert result.code == 1, result.text
    assert "job timed out 1 time(s), more than preemption.max_requeues=0: not requeued" in result.out
    latest = store.find_latest(ckpt_dir(root))
    assert latest is not None and f"committed in {latest}" in result.out
    assert rank_log(root).count("starting fresh") == 1 and "requeueing" not in rank_log(root)
    attrs = read_attrs(result_path(result.out))
    assert attrs["complete"] is False or attrs["complete"] == 0
    assert attrs["timeouts"] == 1 and attrs["final_step"] == int(latest.name[5:13])


def test_unusable_checkpoints_stop_the_job_unless_start_fresh(train_root: Path, tokens: Path) -> None:
    root = train_root / "unusable"
    d = ckpt_dir(root)
    d.mkdir(parents=True)
    (d / "step_00000010.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)  # truncated
    (d / "latest").write_text("")
    failed = train(root, tokens, "--set", "params.steps=2", "--set", "params.optim.warmup_steps=1")
    assert failed.code == 1
    assert f"no usable checkpoint in {d}" in failed.out and "latest is empty" in failed.out
    assert "step_00000010.h5: cannot be read as HDF5" in failed.out
    assert "params.checkpoint.if_unusable=start_fresh" in failed.out
    fresh = train(root, tokens, "--set", "params.steps=2", "--set", "params.optim.warmup_steps=1",
                  "--set", "params.checkpoint.if_unusable=start_fresh")
    assert fresh.code == 0, fresh.text
    assert "starting fresh" in rank_log(root)
    assert store.find_latest(d) == d / "step_00000002.h5"


def test_checkpoint_of_another_model_shape_is_refused(train_root: Path, tokens: Path, reference: Path) -> None:
    root = train_root / "shape"
    shutil.copytree(reference.parent, ckpt_dir(root))
    result = train(root, tokens, "--set", "params.model={n_layer: 1, n_head: 2, d_model: 48, context: 32}")
    assert result.code == 1
    assert "was written for a different model shape" in result.out
    assert "transformer.wte.weight: checkpoint [257, 32] vs model [257, 48]" in result.out
    assert "CheckpointError" in result.out


def test_gradient_accumulation_gives_the_update_of_one_large_batch(train_root: Path, tokens: Path) -> None:
    """2 ranks x (micro 2, accum 2, all-reduce on the last only) vs 2 ranks x micro 4, fp32."""
    few = ["--set", "params.steps=3", "--set", "params.optim.warmup_steps=1", "--set", "params.precision=fp32"]
    big = train(train_root / "accum-1", tokens, *few)
    acc = train(train_root / "accum-2", tokens, *few, "--set", "params.batch.micro=2", "--set", "params.batch.accum=2")
    assert big.code == 0 and acc.code == 0, big.text + acc.text
    a = model_arrays(final_checkpoint(train_root / "accum-1", 3))
    b = model_arrays(final_checkpoint(train_root / "accum-2", 3))
    assert '"loss"' in big.out
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=2e-6, err_msg=key)
    # and the updates are real: training moved every tensor away from the seed's initial weights
    # (an update that did nothing would pass the comparison above), and the logged losses agree
    start = initial_weights(tokens)
    assert sorted(start) == sorted(a)
    moved = [key for key in a if not np.allclose(a[key], start[key], rtol=0, atol=1e-6)]
    assert moved == list(a), sorted(set(a) - set(moved))
    loss_a = float(big.out.split('"loss": ')[1].split(",")[0])
    loss_b = float(acc.out.split('"loss": ')[1].split(",")[0])
    assert abs(loss_a - loss_b) < 1e-4


@pytest.mark.slurm
def test_slurm_preempted_job_requeues_and_resumes_bit_for_bit(train_root: Path, tokens: Path, reference: Path) -> None:
    require_slurm()
    root = train_root / "slurm-preempt"
    jid, result = preempted_slurm_run(root, tokens, "USR2")
    assert_completed_after_one_requeue(jid, result, ranks=2)
    log = rank_log(root, 0)
    stopped = int(re.search(r"USR2 signal received: checkpointing at step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert 20 <= stopped < STEPS
    assert "requeueing job" in log and "(slurm)" in log
    assert f"resumed from {root / 'checkpoints' / 'train_gpt' / f'step_{stopped:08d}.h5'}: step {stopped}" in log
    assert differing(final_checkpoint(root), reference) == []
    attrs = read_attrs(result_path(result.out))
    assert attrs["requeues"] == 1 and attrs["final_step"] == STEPS
    assert attrs["num_nodes"] == 2 and attrs["hosts"] == ["n1", "n2"]

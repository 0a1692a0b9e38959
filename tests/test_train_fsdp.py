"""train_gpt with FSDP2 (``params.parallel: fsdp``) on the local Slurm cluster: preempted at 2
ranks (2 nodes), requeued and resumed, then resumed at 4 ranks (2 nodes x 2) and at 1, each
run reading its own shards of the checkpoint the one before wrote. The last run's weights and
losses are what one process computes from the checkpoint it resumed from, bit for bit; the lr
and tokens seen follow the new world size as they do under DDP."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
import torch.nn.functional as F

from hpcdist.data.dataset import DistributedOrder, TokenWindows
from hpcdist.model.checkpoint import load_model_state
from hpcdist.model.config import GPTConfig
from hpcdist.model.gpt import GPT
from hpcdist.store.results import read_table
from hpcdist.store.sharded import checkpoint as sharded
from hpcdist.train import parallel
from hpcdist.train.schedule import lr_factor
from tests.support import train as fx
from tests.support.cli import require_slurm, result_path
from tests.support.train import Background, ckpt_dir, preempt_and_release, rank_log, train, train_args, wait_for

train_root, tokens = fx.train_root, fx.tokens
LR, WARMUP, CONTEXT, MICRO, STEPS = 3.0e-3, 4, 32, 4, 30
FSDP = ["--set", "params.parallel=fsdp", "--set", f"params.steps={STEPS}",
        "--set", f"params.optim.warmup_steps={WARMUP}", "--set", "params.checkpoint.every=2",
        "--set", "params.eval.every=0", "--set", "params.log_every=1", "--set", "params.checkpoint.keep_last=20"]


def nodes(n: int, tasks: int) -> list[str]:
    return ["--set", f"resources.nodes={n}", "--set", f"resources.tasks_per_node={tasks}"]


def one_process_continuation(index: Path, data: Path, until: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """What one process computes from the sharded checkpoint `index` up to step `until`: the
    trainer's step (AdamW, the cosine schedule, clipping at 1.0) written out here, plain tensors."""
    torch.set_num_threads(1)  # as a rank with one CPU
    cfg, _ = load_model_state(index)
    model = GPT(GPTConfig.model_validate(cfg.model_dump()))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    state = parallel.checkpoint_state(model, opt, cfg.tied)
    sharded.load(index, state)  # 4 ranks' shards into one process
    parallel.load_checkpoint_state(model, opt, state, cfg.tied)
    with h5py.File(index) as f:
        step, epoch, position = int(f.attrs["step"]), int(f["sampler"].attrs["epoch"]), int(
            f["sampler"].attrs["position"])
    train = TokenWindows(data, "train", CONTEXT)
    order = DistributedOrder(len(train), 1, 0, MICRO, 1, 1234)
    losses = []
    while step < until:
        if order.epoch_ends_before(position):
            epoch, position = epoch + 1, 0
        for group in opt.param_groups:
            group["lr"] = LR * lr_factor(step, warmup=WARMUP, total=STEPS, min_ratio=0.1)
        (idx,) = order.step_samples(epoch, position)
        x, y = train.batch(idx)
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        step, position = step + 1, position + order.global_batch
    train.close()
    return dict(model.state_dict()), losses


def stopped(out: str) -> int:
    """The step a run stopped at (its run_steps), from rank 0's summary."""
    match = re.search(r'"step": (\d+)', out)
    assert match, out
    return int(match.group(1))


@pytest.mark.slurm
def test_fsdp_preempted_and_resumed_at_2_then_4_then_1_ranks(train_root: Path, tokens: Path) -> None:
    require_slurm()
    root = train_root / "fsdp-2-4-1"
    job = Background(train_args(root, tokens, *nodes(2, 1), *FSDP, "--set", "params.run_steps=10",
                                site="local-slurm"))
    try:
        wait_for(lambda: f"step 2/{STEPS}" in rank_log(root), 120, "step 2 in rank 0's log")
        jid = next(p.name for p in (root / "logs" / "train_gpt").iterdir() if p.name.isdigit())
        preempt_and_release(jid, "USR2")
        first = job.finish(timeout=180)
    finally:
        job.kill()
    assert first.code == 0, first.text
    log = rank_log(root)
    match = re.search(r"USR2 signal received: checkpointing at step (\d+)", log)
    assert match, log[-3000:]
    preempted = int(match.group(1))
    assert f"resumed from {ckpt_dir(root) / f'step_{preempted:08d}.h5'}: step {preempted}" in log
    at_2 = stopped(first.out)
    assert at_2 == preempted + 10 < STEPS - 3

    second = train(root, tokens, *nodes(2, 2), *FSDP, "--set", "params.run_steps=3", site="local-slurm")
    assert second.code == 0 and "4/4 ranks succeeded" in second.out, second.text
    at_4 = stopped(second.out)
    assert at_4 == at_2 + 3
    third = train(root, tokens, *nodes(1, 1), *FSDP, site="local-slurm")
    assert third.code == 0 and "1/1 ranks succeeded" in third.out, third.text
    log = rank_log(root)
    for ranks in (2, 4, 1):  # TINY's one block
        assert f"FSDP2: 1 block(s) and the root sharded over {ranks} rank(s)" in log
    assert "resuming at another world size: 4 ranks" in log and "resuming at another world size: 1 ranks" in log

    final = ckpt_dir(root) / f"step_{STEPS:08d}.h5"
    weights, losses = one_process_continuation(ckpt_dir(root) / f"step_{at_4:08d}.h5", tokens, STEPS)
    _, saved = load_model_state(final)
    assert sorted(weights) == sorted(saved)
    assert [k for k in weights if not torch.equal(weights[k], saved[k])] == []
    with h5py.File(result_path(third.out)) as f:
        steps: dict[str, Any] = read_table(f["train/steps"])
    assert steps["step"].tolist() == list(range(1, STEPS + 1))
    assert steps["loss"].tolist()[at_4:] == losses
    world = {s: 2 if s <= at_2 else 4 if s <= at_4 else 1 for s in range(1, STEPS + 1)}
    assert steps["tokens_seen"].tolist() == [sum(world[t] * MICRO * CONTEXT for t in range(1, s + 1))
                                             for s in range(1, STEPS + 1)]
    for s, got in zip(steps["step"].tolist(), steps["lr"].tolist(), strict=True):
        assert math.isclose(got, LR * lr_factor(s - 1, warmup=WARMUP, total=STEPS, min_ratio=0.1), rel_tol=1e-12)


def test_a_flipped_byte_in_a_shard_resumes_from_the_step_before(train_root: Path, tokens: Path) -> None:
    """On the local site: a byte flipped in rank 1's shard of the newest checkpoint is named (file,
    tensor) when a 1-rank run resumes, and the step before is used."""
    root = train_root / "fsdp-flipped"
    sets = [*FSDP, "--set", "params.steps=6", "--set", "params.optim.warmup_steps=2"]
    first = train(root, tokens, *sets)
    assert first.code == 0, first.text
    index = ckpt_dir(root) / "step_00000006.h5"
    md = sharded.ShardedReader(index).read_metadata()
    fqn, chunk = next((i.fqn, c) for i, c in md.storage_data.items()
                      if c.rank == 1 and c.torch_dtype and c.offset >= 0 and i.fqn.startswith("model."))
    shard = sharded.shards_dir(ckpt_dir(root), 6) / chunk.file
    with open(shard, "r+b") as f:
        f.seek(chunk.offset)
        byte = f.read(1)
        f.seek(chunk.offset)
        f.write(bytes([byte[0] ^ 0x04]))
    second = train(root, tokens, *nodes(1, 1), *sets, "--set", "params.steps=8")
    assert second.code == 0, second.text
    log = rank_log(root)
    assert f"checkpoint {index} not loaded: " in log and str(shard) in log and f"tensor {fqn} " in log
    assert f"resumed from {ckpt_dir(root) / 'step_00000004.h5'}: step 4" in log
    assert stopped(second.out) == 8

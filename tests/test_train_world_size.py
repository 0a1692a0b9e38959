"""train_gpt resumed at another world size (data parallel: model and optimizer state do not depend
on it, so it resumes, as Lightning and torch.distributed.checkpoint users expect): the lr after the
resume is the new world size's schedule (``lr_scaling: linear``), every rank gets a full
micro-batch (the data order goes on from the same sample, or from the next epoch when a whole new
global batch no longer fits), and the tokens seen go on from where the run stopped."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdist.data.dataset import DistributedOrder
from hpcdist.errors import JobError
from hpcdist.store.results import read_table
from hpcdist.train.schedule import lr_factor
from tests.support import train as fx
from tests.support.cli import result_path
from tests.support.train import final_checkpoint, prepare_tokens, rank_log, train

train_root = fx.train_root
LR, WARMUP, CONTEXT, MICRO = 3.0e-3, 20, 32, 4  # jobs/train_gpt.yaml's lr and warm-up, TINY's shape


@pytest.fixture(scope="module")
def tokens(train_root: Path) -> Path:
    """A quarter of the session's corpus: one rank reaches the end of epoch 0 in ~110 steps, not ~450."""
    return prepare_tokens(train_root, "tokens-quarter", words=3000)


def train_samples(tokens: Path) -> int:
    with h5py.File(tokens) as f:
        return (int(f["train"].shape[0]) - 1) // CONTEXT


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_resume_at_another_world_size_follows_the_new_schedule(before: int, after: int, train_root: Path,
                                                               tokens: Path) -> None:
    root = train_root / f"world-{before}-{after}"
    if before == 1:  # stop at the last step of epoch 0 whose 4 samples fit, but not 2 ranks' 8
        stop = train_samples(tokens) // (MICRO * before) - 1
    else:
        stop = 30
    total = stop + 20
    common = ["--set", f"params.steps={total}", "--set", "params.optim.lr_scaling=linear"]
    first = train(root, tokens, *common, "--set", f"resources.tasks_per_node={before}",
                  "--set", f"params.run_steps={stop}")
    assert first.code == 0, first.text
    second = train(root, tokens, *common, "--set", f"resources.tasks_per_node={after}")
    assert second.code == 0, second.text

    def lr(world: int, step: int) -> float:  # linear scaling, the reference batch is one rank's
        return LR * world * lr_factor(step - 1, warmup=WARMUP, total=total, min_ratio=0.1)

    with h5py.File(result_path(second.out)) as f:
        steps = read_table(f["train/steps"])
    assert steps["step"].tolist() == list(range(1, total + 1))
    assert np.isfinite(steps["loss"]).all()  # no rank trained on an empty micro-batch
    for s, got in zip(steps["step"].tolist(), steps["lr"].tolist(), strict=True):
        assert math.isclose(got, lr(before if s <= stop else after, s), rel_tol=1e-12), (s, got)
    tokens_per_step = {w: w * MICRO * CONTEXT for w in (before, after)}
    expected = [s * tokens_per_step[before] if s <= stop else stop * tokens_per_step[before]
                + (s - stop) * tokens_per_step[after] for s in range(1, total + 1)]
    assert steps["tokens_seen"].tolist() == expected
    with h5py.File(final_checkpoint(root, total)) as f:  # the optimizer's own lr, not the log's
        base_lrs = json.loads(f["scheduler"].attrs["state_json"])["base_lrs"]
        groups = json.loads(f["optimizer"].attrs["param_groups_json"])
    assert base_lrs == [LR * after] * 2
    assert [g["initial_lr"] for g in groups] == [LR * after] * 2
    assert all(math.isclose(g["lr"], lr(after, total + 1), rel_tol=1e-12) for g in groups)
    assert "resuming at another world size" in rank_log(root)


def test_a_step_past_the_epoch_is_an_error_not_a_short_micro_batch() -> None:
    """One rank stopped at sample 4 of 10 (a step of 4 still fits); at two ranks a step of 8 does
    not: the epoch ends there, and the order refuses a step that would run past it."""
    one = DistributedOrder(num_samples=10, world_size=1, rank=0, micro_batch=4, accum=1, seed=0)
    two = DistributedOrder(num_samples=10, world_size=2, rank=1, micro_batch=4, accum=1, seed=0)
    assert not one.epoch_ends_before(4) and two.epoch_ends_before(4)
    assert [len(m) for m in two.step_samples(1, 0)] == [4]
    with pytest.raises(JobError, match="runs past the epoch's 10 samples"):
        two.step_samples(0, 4)  # rank 1 would get samples 8 and 9 of its 4

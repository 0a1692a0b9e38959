"""A train_gpt run stopped and resumed from its checkpoint at 3 ranks ends with the uninterrupted
run's model and losses, bit for bit (with 2 ranks any order of addition gives the same sum; with
3 the order matters, and a new DDP used to take its first step in another bucket layout than
the run it resumed: ``hpcdist.train.parallel.ready_order``). Through ``hpcdist submit --wait``
on the local site, as a user stops a run with ``params.run_steps`` and submits it again."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from hpcdist.store.results import read_table
from tests.support import train as fx
from tests.support.cli import result_path
from tests.support.train import differing, final_checkpoint, rank_log, train

train_root, tokens = fx.train_root, fx.tokens
STEPS = 60
THREE = ("--set", "resources.tasks_per_node=3", "--set", f"params.steps={STEPS}", "--set",
         "params.checkpoint.every=20", "--set", "params.log_every=7")


def losses(out: str) -> np.ndarray:
    with h5py.File(result_path(out)) as f:
        table = read_table(f["train/steps"])
    assert table["step"].tolist() == list(range(1, STEPS + 1))  # each step once
    return np.asarray(table["loss"])


def test_a_run_resumed_at_three_ranks_equals_the_uninterrupted_run_bit_for_bit(train_root: Path,
                                                                                 tokens: Path) -> None:
    straight = train(train_root / "exact-straight", tokens, *THREE)
    assert straight.code == 0, straight.text
    root = train_root / "exact-resumed"
    first = train(root, tokens, *THREE, "--set", "params.run_steps=23")
    assert first.code == 0, first.text
    again = train(root, tokens, *THREE)
    assert again.code == 0, again.text
    assert "step_00000023.h5: step 23" in rank_log(root), rank_log(root)[-2000:]  # the stop's checkpoint
    assert differing(final_checkpoint(root, STEPS), final_checkpoint(train_root / "exact-straight", STEPS)) == []
    assert np.array_equal(losses(again.out), losses(straight.out))

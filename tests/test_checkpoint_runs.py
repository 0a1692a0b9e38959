"""Runs in one checkpoint directory on the local site: train_gpt with ``resume: false`` in a
directory holding an earlier run's checkpoints sets them aside at its start (one line), so
neither it nor a requeue of it resumes, prunes or mixes with them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcdist.store import CheckpointStore, read
from tests.support import train as fx
from tests.support.train import ckpt_dir, rank_log, train

train_root, tokens = fx.train_root, fx.tokens  # session fixtures: the token file, made once


def test_train_gpt_resume_false_sets_the_earlier_runs_checkpoints_aside(train_root: Path, tokens: Path) -> None:
    root = train_root / "runs"
    d = ckpt_dir(root)
    earlier = CheckpointStore(d, job_id="100")  # an earlier job's run: steps 1000 and 2000
    for step in (1000, 2000):
        earlier.save(step, {"model": {"w": np.full(3, step, np.float32)}})
    result = train(root, tokens, "--set", "params.steps=4", "--set", "params.checkpoint.every=2",
                   "--set", "params.checkpoint.keep_last=3", "--set", "params.optim.warmup_steps=1",
                   "--set", "params.eval.every=100", "--set", "params.checkpoint.resume=false")
    assert result.code == 0, result.text
    kept = d / "previous" / f"run-{earlier.run_id}"
    line = (f"params.checkpoint.resume is false: new run {read(d / 'step_00000004.h5').attrs['run_id']} in {d}: "
            f"moved the 2 checkpoint(s) already there (steps 1000, 2000, run {earlier.run_id}) and their latest "
            f"to {kept}")
    assert rank_log(root).count(line) == 1, rank_log(root)
    # nothing of the earlier run is left where this run, or a requeue of it, would look
    assert sorted(p.name for p in d.glob("step_*.h5")) == ["step_00000002.h5", "step_00000004.h5"]
    assert sorted(p.name for p in kept.iterdir()) == ["latest", "step_00001000.h5", "step_00002000.h5"]
    assert CheckpointStore(d).steps() == [2, 4] and "resumed from" not in rank_log(root)

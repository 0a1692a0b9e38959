"""train_gpt compiled (``params.compile=true``) against eager, on CPU, as a user submits it on the
local site: a few steps of a tiny model give the same losses within LOSS_RTOL, with checkpoints
written eager resumed compiled and back; the compiled code is cached in the user's own folder of
the scratch, and the log says how long the first step took and why. Beside them,
without a job: the head's vocabulary padding (the matmul on a multiple of 64, logits and the loss
on the real vocabulary) and the spec's refusal of a ``params.compile`` that is not auto, true or false.

Compiling on CPU takes ~20 s the first time (the one cold compile of the module, shared by its runs)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hpcdist.config import load_site
from hpcdist.errors import ConfigError
from hpcdist.kinds.registry import load_job
from hpcdist.model.gpt import GPT, GPTConfig, head_logits, head_loss, padded_vocab
from hpcdist.model.shapes import parameter_shapes
from hpcdist.store.results import read_table
from hpcdist.train.checkpoint import stop_every
from tests.support import train as fx
from tests.support.cli import REPO, result_path, run_cli, storage_sets

train_root, tokens = fx.train_root, fx.tokens

# Compiled kernels sum in another order than eager ones: after 8 steps of the tiny model the
# losses differ by ~1e-6 (measured); 1e-4 relative is the promise, loose enough for any CPU.
LOSS_RTOL = 1e-4
STEPS = 8
SHAPE = ["--set", "params.model={n_layer: 1, n_head: 2, d_model: 32, context: 32}",
         "--set", "params.batch.micro=4", "--set", "params.batch.accum=1", "--set", f"params.steps={STEPS}",
         "--set", "params.optim.warmup_steps=2", "--set", "params.checkpoint.every=2", "--set", "params.eval.every=0",
         "--set", "params.log_every=1", "--set", "timeout_s=120", "--set", "resources.tasks_per_node=1"]


def submit(root: Path, tokens: Path, scratch: Path, *sets: str) -> dict[int, float]:
    """`hpcdist submit jobs/train_gpt.yaml --site local --wait`, storage under `root` but the
    scratch (the compile cache's home) shared; the run's {step: loss} from its result file."""
    args = ["submit", "jobs/train_gpt.yaml", "--site", "local", "--wait", *storage_sets(root),
            "--set", f"site.storage.scratch={scratch}", "--set", f"params.data={tokens}", *SHAPE]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # hpcdist's own choice of cache
    proc = subprocess.run([sys.executable, "-m", "hpcdist.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env={**env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with h5py.File(result_path(proc.stdout), "r") as f:
        table = read_table(f["train/steps"])
    return {int(s): float(v) for s, v in zip(table["step"], table["loss"], strict=True)}


def test_compiled_matches_eager_and_checkpoints_cross(train_root: Path, tokens: Path) -> None:
    scratch = train_root / "compile-scratch"
    eager = submit(train_root / "eager", tokens, scratch, "params.compile=false")
    assert sorted(eager) == list(range(1, STEPS + 1))

    # eager for half the run, compiled from its checkpoint for two steps, eager again from the compiled one's
    mixed = train_root / "mixed"
    submit(mixed, tokens, scratch, "params.compile=false", f"params.run_steps={STEPS // 2}")
    submit(mixed, tokens, scratch, "params.compile=true", "params.run_steps=2")
    whole = submit(mixed, tokens, scratch, "params.compile=false")
    log = "".join(p.read_text() for p in sorted((mixed / "logs" / "train_gpt").glob("*/train_rank0.log")))
    assert "step 5 took" in log and "includes torch.compile's work on the blocks and the head" in log, log
    assert log.count("resumed from") == 2, log  # compiled from the eager run's checkpoint, and back

    assert sorted(whole) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert whole[step] == pytest.approx(eager[step], rel=LOSS_RTOL), (step, whole[step], eager[step])
    assert [whole[s] for s in (5, 6)] != [eager[s] for s in (5, 6)]  # compiled: close, yet not the same kernels

    caches = list(scratch.rglob("torchinductor"))
    assert len(caches) == 1 and any(caches[0].iterdir()), caches
    assert stat.S_IMODE(caches[0].stat().st_mode) == 0o700


class MatmulShapes(TorchDispatchMode):
    """The (rows, cols) of every weight a matmul multiplies by, as the kernels see them."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.widths.append(int(args[-1].shape[-1]))
        return func(*args, **(kwargs or {}))


def test_head_pads_the_matmul_not_the_vocabulary() -> None:
    assert padded_vocab(50257) == 50304 and padded_vocab(257) == 320 and padded_vocab(64) == 64
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 16), torch.randn(257, 16) * 0.1
    y = torch.randint(257, (2, 5))
    with MatmulShapes() as seen:
        logits = head_logits(x, w, 257, multiple=64)
    assert seen.widths == [320]  # the kernel multiplies by 320 rows, 63 of them zero
    assert logits.shape == (2, 5, 257)
    torch.testing.assert_close(logits, F.linear(x, w), rtol=1e-6, atol=1e-6)
    expected = F.cross_entropy(F.linear(x, w).reshape(-1, 257), y.reshape(-1))
    torch.testing.assert_close(head_loss(x, w, y, 257, multiple=64), expected, rtol=1e-6, atol=1e-6)

    # the model's parameters, state dict and logits keep the real vocabulary (checkpoints, exports)
    cfg = GPTConfig(vocab_size=257, n_layer=1, n_head=2, d_model=16, context=8)
    model = GPT(cfg)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"} == parameter_shapes(cfg)
    idx = torch.randint(257, (2, 8))
    assert model(idx).shape == (2, 8, 257)
    torch.testing.assert_close(model(idx, idx), F.cross_entropy(model(idx).reshape(-1, 257), idx.reshape(-1)))


def test_compile_param_is_checked(tmp_path: Path) -> None:
    corpus = fx.write_corpus(tmp_path / "c.txt", words=3000)
    out = tmp_path / "tokens.h5"
    assert run_cli("data", "prepare", str(corpus), "-o", str(out)).code == 0
    site = load_site("local", [s.removeprefix("site.") for s in storage_sets(tmp_path)[1::2]])
    with pytest.raises(ConfigError) as err:
        load_job(REPO / "jobs" / "train_gpt.yaml", site, [f"params.data={out}", "params.compile=sometimes"])
    assert "params.compile" in str(err.value) and "sometimes" in str(err.value)
    job = load_job(REPO / "jobs" / "train_gpt.yaml", site, [f"params.data={out}"])
    assert job.params.compile == "auto"


def test_stop_agreement_every_second_or_every_step() -> None:
    """The ranks agree on a stop about once a second, every step when steps are slower, never
    further apart than log_every: a fast step does not wait for the device each time."""
    assert stop_every(10, 0.01) == 10
    assert stop_every(200, 0.01) == 100
    assert stop_every(10, 2.0) == 1
    assert stop_every(10, 0.0) == 1
    assert np.all([stop_every(50, s) >= 1 for s in (1e-6, 0.3, 5.0)])

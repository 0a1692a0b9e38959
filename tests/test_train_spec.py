"""The train_gpt spec is checked before anything launches: each bad value is named by its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist.config import load_site
from hpcdist.errors import ConfigError
from hpcdist.kinds.registry import load_job
from hpcdist.train.params import effective_precision
from hpcdist.train.schedule import lr_factor, scaled_lr
from tests.support.cli import REPO, run_cli, storage_sets
from tests.support.train import write_corpus


@pytest.fixture(scope="module")
def small_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("spec")
    out = d / "tokens.h5"
    assert run_cli("data", "prepare", str(write_corpus(d / "c.txt", words=3000)), "-o", str(out)).code == 0
    return out


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["params.precision=fp16"],
         "params.precision: 'fp16' cannot run on site 'local'; fp16 with a loss scaler needs GPUs"),
        (["params.model={d_model: 30, n_head: 4}"],
         "params.model: {'d_model': 30, 'n_head': 4} cannot run on site 'local'; "
         "d_model 30 is not a multiple of n_head 4"),
        (["params.model={n_layers: 2}"], "params.model.n_layers"),
        (["params.model={vocab_size: 100}"], "params.model.vocab_size: 100 cannot run on site 'local'; at least 257"),
        (["params.batch.micro=5000"], "params.batch.micro: 5000 cannot run on site 'local'; the training split"),
        (["params.optim.lr_scaling=cube"], "params.optim.lr_scaling: Input should be 'none', 'linear' or 'sqrt'"),
        (["params.checkpoint.if_unusable=maybe"], "params.checkpoint.if_unusable"),
        (["params.steps=60", "params.optim.warmup_steps=500"], "warmup_steps 500 is more than steps 60"),
        (["params.parallel={dp_replicate: 2, dp_shard: 2}"],
         "params.parallel: {'dp_replicate': 2, 'dp_shard': 2} cannot run on site 'local'; dp_replicate 2 x dp_shard 2 "
         "does not make the world size 2 (nodes x tasks per node); set one of them to -1 or make their product 2"),
        (["params.parallel={dp_replicate: -1, dp_shard: 3}"], "dp_replicate -1 x dp_shard 3 does not make the world "
         "size 2"),
        (["params.parallel=zero3"], "parallel 'zero3' is not a known form; use ddp, fsdp, or a block"),
        (["params.parallel={dp_replicate: -1, dp_shard: -1}"], "at most one may take the rest of the ranks"),
        (["params.parallel=fsdp", "params.precision=fp16"], "FSDP runs without a loss scaler; use bf16"),
    ],
)
def test_bad_params_are_named(small_tokens: Path, tmp_path: Path, sets: list[str], expected: str) -> None:
    """In-process load_job: the text `hpcdist submit`/`render` print (see the test below for the CLI)."""
    site = load_site("local", [s.removeprefix("site.") for s in storage_sets(tmp_path)[1::2]])
    with pytest.raises(ConfigError) as err:
        load_job(REPO / "jobs" / "train_gpt.yaml", site, [f"params.data={small_tokens}", *sets])
    assert expected in str(err.value)


def test_missing_token_file_says_how_to_make_it(tmp_path: Path) -> None:
    """`submit` refuses in one line; `render` stays usable (storage not mounted here): a warning."""
    sets = ["--set", f"params.data={tmp_path / 'none.h5'}", *storage_sets(tmp_path)]
    result = run_cli("submit", "jobs/train_gpt.yaml", *sets)
    assert result.code == 2 and result.err.count("\n") == 1  # one line, no traceback
    assert "jobs/train_gpt.yaml: params.data:" in result.err and "hpcdist data prepare" in result.err
    assert not list(tmp_path.rglob("*.pkl"))  # nothing was submitted
    result = run_cli("render", "jobs/train_gpt.yaml", "--site", "local-slurm", *sets)
    assert result.code == 0 and result.out.startswith("#!/bin/bash"), result.text
    assert result.err.startswith("hpcdist: warning: jobs/train_gpt.yaml: params.data:") and "data prepare" in result.err


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    f = [lr_factor(s, warmup=10, total=110, min_ratio=0.1) for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    assert lr_factor(110, warmup=10, total=110, min_ratio=0.1) == pytest.approx(0.1)


def test_lr_scaling_rules() -> None:
    assert scaled_lr(1e-3, "none", 64, 16) == 1e-3
    assert scaled_lr(1e-3, "linear", 64, 16) == pytest.approx(4e-3)
    assert scaled_lr(1e-3, "sqrt", 64, 16) == pytest.approx(2e-3)


@pytest.mark.parametrize(
    ("requested", "device", "bf16_ok", "used"),
    [
        ("auto", "cuda", True, "bf16"),
        ("auto", "cuda", False, "fp32"),  # pre-Ampere GPUs
        ("auto", "cpu", False, "fp32"),
        ("bf16", "cpu", False, "bf16"),  # asked for explicitly
        ("fp16", "cuda", True, "fp16"),
    ],
)
def test_auto_precision_is_bf16_on_capable_gpus_and_fp32_elsewhere(
    requested: str, device: str, bf16_ok: bool, used: str
) -> None:
    assert effective_precision(requested, device, bf16_ok) == used

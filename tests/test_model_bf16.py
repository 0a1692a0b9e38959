"""A bf16 model stays bf16: ``hpcdist model import`` of a bfloat16 ``save_pretrained`` folder keeps its
tensors as bfloat16 in the checkpoint (the store's one bits encoding, what ``h5dump`` shows), inference
and training read them into float32 and compute there, tensor-parallel shard reads give the same
tensors as the whole read, and ``model export`` writes the very safetensors bytes it imported."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch

from hpcdist.model.checkpoint import load_model_state, read_header
from hpcdist.model.gpt import GPT
from tests.support.cli import require_module
from tests.support.hf import cli
from tests.support.infer import run_ranks
from tests.support.llama import make_llama

require_module("transformers")

ATOL = 2e-5  # as tests/test_model_llama.py: the same float32 weights, sums in another order
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [250, 8], [12, 13, 14, 15, 16]]  # ragged, left-padded in one batch


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Any]]:
    """(folder, imported checkpoint, transformers model in bf16) of a GQA Llama with an untied head and a tied
    Qwen2, both saved in bfloat16 and imported as `hpcdist model import` does."""
    from hpcdist.model.hf import import_pretrained

    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for variant in ("llama3-gqa", "qwen2"):
        model = make_llama(root / variant, variant, dtype=torch.bfloat16)
        assert import_pretrained(root / variant, root / f"{variant}.h5").dtype == "bfloat16"  # what the CLI prints
        out[variant] = (root / variant, root / f"{variant}.h5", model)
    return out


@pytest.mark.parametrize("variant", ["llama3-gqa", "qwen2"])
def test_a_bf16_import_stays_bf16_and_exports_the_same_safetensors_bytes(
    bf16: dict[str, tuple[Path, Path, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str], variant: str
) -> None:
    folder, checkpoint, model = bf16[variant]
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    header = read_header(checkpoint)
    assert set(header.dtypes.values()) == {"bfloat16"}
    assert header.nbytes == 2 * sum(math.prod(shape) for shape in header.shapes.values())
    with h5py.File(checkpoint, "r") as f:  # what h5dump shows: the bits as 16-bit integers, named bfloat16
        ds = f["model/transformer.wte.weight"]
        assert (ds.dtype.str, ds.attrs["torch_dtype"]) == ("<u2", "bfloat16")
    _, state = load_model_state(checkpoint)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert torch.equal(state["transformer.wte.weight"], model.model.embed_tokens.weight)  # bit for bit
    out = tmp_path / "export"
    code, _, err = cli(capsys, "model", "export", str(checkpoint), "-o", str(out))
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def _shard_run(rank: int, world: int, file: str, idx: torch.Tensor, new: int) -> dict[str, Any]:
    from hpcdist.infer.generate import Sampling, generate
    from hpcdist.infer.shard_load import read_shard, shard_state
    from hpcdist.infer.tp import TPGPT, TPGroup
    from hpcdist.model.checkpoint import read_full

    header = read_header(file)
    shard = read_shard(header, rank, world, rank, world)
    in_memory = shard_state(read_full(header), header.config, rank, world)  # what load: broadcast slices
    assert shard.bad == [] and {t.dtype for t in shard.state.values()} == {torch.bfloat16}
    assert all(torch.equal(shard.state[k], in_memory[k]) for k in in_memory)
    model = TPGPT(header.config, TPGroup(rank, world, None))
    model.load_shard(shard.state)
    assert model.wte.weight.dtype == torch.float32  # computed in float32
    return {"logits": model(idx), "tokens": generate(model, PROMPTS, Sampling(max_new_tokens=new, end_token=1)).tokens}


@pytest.mark.parametrize("tp", [1, 2])
def test_generation_from_a_bf16_checkpoint_equals_transformers_on_the_same_weights_in_float32(
    bf16: dict[str, tuple[Path, Path, Any]], tp: int
) -> None:
    """`load: shard`'s reader at tp 2 (each rank reads its part of the bf16 tensors), and the whole model
    training starts from (`params.init` loads through the same `load_model_state`)."""
    from transformers import AutoModelForCausalLM

    from hpcdist.infer.hf import hf_generate_greedy

    folder, checkpoint, _ = bf16["llama3-gqa"]
    # the same bf16 weights, widened as hpcdist widens them (not `model.float()`: its rotary frequencies were
    # rounded to bf16 with the weights)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    idx = torch.randint(0, 317, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(idx).logits
    theirs = hf_generate_greedy(reference, PROMPTS, 12, end_token=1)
    for rank, out in enumerate(run_ranks(tp, _shard_run, str(checkpoint), idx, 12)):
        torch.testing.assert_close(out["logits"], want, atol=ATOL, rtol=0, msg=f"rank {rank}")
        assert out["tokens"] == theirs, f"rank {rank}"
    cfg, state = load_model_state(checkpoint)
    whole = GPT(cfg).eval()
    whole.load_state_dict(state)
    assert {p.dtype for p in whole.parameters()} == {torch.float32}
    with torch.no_grad():
        torch.testing.assert_close(whole(idx), want, atol=ATOL, rtol=0)


def test_infer_gpt_broadcasts_a_bf16_checkpoint_as_bf16_and_generates_transformers_tokens(
    bf16: dict[str, tuple[Path, Path, Any]], tmp_path: Path
) -> None:
    """The inference job on the local site, tp 2, `load: broadcast`: rank 0 sends the stored bf16 bytes
    (half of float32's), every rank checks their sha256 and computes in float32 (`params.dtype`)."""
    from transformers import AutoModelForCausalLM

    from hpcdist.infer.hf import hf_generate_greedy
    from tests.support.cli import run_cli, storage_sets

    folder, checkpoint, _ = bf16["llama3-gqa"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe cluster runs jobs\nab\n")
    run = run_cli("submit", "jobs/infer_gpt.yaml", "--site", "local", "--wait", *storage_sets(tmp_path),
                  "--set", f"params.prompts={prompts}", "--set", f"params.checkpoint={checkpoint}",
                  "--set", "params.load=broadcast", "--set", "params.max_new_tokens=10",
                  "--set", "params.dtype=float32", timeout=240)
    assert run.code == 0, run.text
    (path,) = (tmp_path / "results" / "infer_gpt").glob("*.h5")
    with h5py.File(path, "r") as f:
        assert f.attrs["dtype"] == "float32"
        asked = [list(map(int, p)) for p in f["tokens/prompt_ids"]]
        outputs = [list(map(int, o)) for o in f["tokens/output_ids"]]
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert outputs == hf_generate_greedy(reference, asked, 10, end_token=1)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").rglob("*") if p.is_file())
    assert "weights loaded by broadcast" in logs and f"({read_header(checkpoint).nbytes} bytes)" in logs


def test_infer_gpt_keeps_a_bf16_checkpoint_in_bf16_and_reports_each_ranks_memory(
    bf16: dict[str, tuple[Path, Path, Any]], tmp_path: Path
) -> None:
    """No `params.dtype`: the model and its KV cache stay in the checkpoint's bfloat16 (upcast, every
    rank would hold twice the weights the README's per-rank figures say); the result file says so."""
    from hpcdist.infer.sizing import tp_costs
    from hpcdist.store.results import read_table
    from tests.support.cli import run_cli, storage_sets

    _, checkpoint, _ = bf16["llama3-gqa"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe cluster runs jobs\nab\n")
    run = run_cli("submit", "jobs/infer_gpt.yaml", "--site", "local", "--wait", *storage_sets(tmp_path),
                  "--set", f"params.prompts={prompts}", "--set", f"params.checkpoint={checkpoint}",
                  "--set", "params.max_new_tokens=10", timeout=240)
    assert run.code == 0, run.text
    (path,) = (tmp_path / "results" / "infer_gpt").glob("*.h5")
    cfg = read_header(checkpoint).config
    with h5py.File(path, "r") as f:
        assert f.attrs["dtype"] == "bfloat16"
        longest = max(len(p) for p in f["tokens/prompt_ids"])
        ranks = read_table(f["ranks"])
    paper = tp_costs(cfg, 2, dtype_bytes=2)  # the README's per-rank table
    # beyond the table: the head's rows stored once more, transposed (the decode step's layout), and the
    # rotary frequencies in float32
    extra = -(-cfg.vocab_size // 2) * cfg.d_model * 2 + cfg.d_head // 2 * 4
    # the table pads the untied head to equal slices; the last rank's holds one row fewer here (317 rows)
    assert [paper.weight_bytes_per_rank + extra - int(b) for b in ranks["weight_bytes"]] == [0, cfg.d_model * 2]
    batch = 3  # every prompt in one batch, on each rank of the tp group
    want_kv = paper.kv_cache_bytes_per_token * batch * (longest + 10)
    assert list(ranks["kv_cache_peak_bytes"]) == [want_kv] * 2


def test_finetune_from_a_bf16_checkpoint_trains_float32_weights_from_the_same_values(
    bf16: dict[str, tuple[Path, Path, Any]], tmp_path: Path
) -> None:
    """train_gpt with `params.init` of the bf16 import (2 ranks, DDP, local site): it starts from the bf16 values
    widened and writes the float32 master weights it trains."""
    from tests.support.cli import run_cli, storage_sets
    from tests.support.train import write_corpus

    _, checkpoint, _ = bf16["qwen2"]
    tokens = tmp_path / "tokens.h5"
    made = run_cli("data", "prepare", str(write_corpus(tmp_path / "corpus.txt", words=3000)), "-o", str(tokens),
                   "--tokenizer", str(checkpoint))
    assert made.code == 0, made.text
    run = run_cli("submit", "jobs/finetune_gpt.yaml", "--site", "local", "--wait", *storage_sets(tmp_path),
                  "--set", f"params.init={checkpoint}", "--set", f"params.data={tokens}",
                  "--set", "params.model.context=32", "--set", "params.steps=2", "--set", "params.batch.accum=1",
                  "--set", "params.optim.warmup_steps=0", "--set", "params.eval.every=0",
                  "--set", "params.checkpoint.every=2", "--set", "timeout_s=120", timeout=300)
    assert run.code == 0, run.text
    header = read_header(tmp_path / "checkpoints" / "finetune_gpt" / "step_00000002.h5")
    assert set(header.dtypes.values()) == {"float32"}
    _, before = load_model_state(checkpoint)
    _, after = load_model_state(header.path)
    deltas = [float((after[k] - before[k].float()).abs().max()) for k in after]
    assert 0 < max(deltas) < 0.1  # moved a little from the bf16 values, not from anywhere else

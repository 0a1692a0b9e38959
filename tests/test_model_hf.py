"""Hugging Face GPT-2 in and out (``hpcdist model import/export``), with its tokenizer: logits equal
transformers' after import, after export and under tensor parallelism; bad folders fail in one line.
Every model and tokenizer is made here (tests.support.hf): nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist.model.checkpoint import checkpoint_tokenizer, load_model_state, read_header
from hpcdist.model.gpt import GPT
from hpcdist.store import verify
from tests.support.cli import require_module
from tests.support.hf import VOCAB, Pretrained, cli, make_pretrained
from tests.support.infer import run_ranks

require_module("transformers")

# The same float32 arithmetic in another order (fused attention, then all-reduced partial sums):
# logits of these small models agree to a few ulps.
ATOL = 2e-5
TEXT = "the quick brown fox jumps over the lazy dog"


def _ids(n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))




@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_import_gives_transformers_logits_and_carries_the_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pretrained: Pretrained, weights: str
) -> None:
    from transformers import AutoTokenizer

    if weights == "safetensors":
        out, hf, folder = pretrained.checkpoint, pretrained.model, pretrained.directory
    else:  # pytorch_model.bin, and vocab.json + merges.txt in place of tokenizer.json
        folder, out = tmp_path / "hf", tmp_path / "ckpt"  # a checkpoint directory this time
        hf = make_pretrained(folder, safetensors=False, tokenizer_json=False)
        assert (folder / "pytorch_model.bin").is_file() and not (folder / "tokenizer.json").exists()
        code, _, err = cli(capsys, "model", "import", str(folder), "-o", str(out))
        assert code == 0, err
        out = out / "step_00000000.h5"
    verify(out)  # every tensor has its sha256, and it holds
    cfg, state = load_model_state(out)
    assert (cfg.vocab_size, cfg.context, cfg.n_layer, cfg.d_model) == (VOCAB, 64, 2, 32)
    model = GPT(cfg).eval()
    model.load_state_dict(state)
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=ATOL, rtol=0)
    ours = checkpoint_tokenizer(out, cfg)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    assert ours.encode_text(TEXT) == theirs(TEXT).input_ids
    assert ours.eot_id == theirs.eos_token_id and ours.decode(ours.encode_text(TEXT)) == TEXT


def test_export_loads_in_transformers_with_the_same_logits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pretrained: Pretrained
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, hf = pretrained.checkpoint, pretrained.model
    code, _, err = cli(capsys, "model", "export", str(out), "-o", str(tmp_path / "exported"))
    assert code == 0, err
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, hf(idx).logits, atol=ATOL, rtol=0)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "exported"))
    assert tok(TEXT).input_ids == AutoTokenizer.from_pretrained(str(pretrained.directory))(TEXT).input_ids
    code, _, err = cli(capsys, "model", "export", str(out), "-o", str(tmp_path / "exported"))
    assert code == 2 and "already exists" in err


def _tp_logits(rank: int, world: int, file: str, idx: torch.Tensor) -> torch.Tensor:
    from hpcdist.infer.shard_load import read_shard
    from hpcdist.infer.tp import TPGPT, TPGroup

    header = read_header(file)
    model = TPGPT(header.config, TPGroup(rank, world, None))
    model.load_shard(read_shard(header, rank, world, rank, world).state)
    with torch.no_grad():
        return model(idx)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_logits_of_an_imported_model_equal_transformers(pretrained: Pretrained, tp: int) -> None:
    out, hf = pretrained.checkpoint, pretrained.model
    idx = _ids(20, seed=tp)
    with torch.no_grad():
        want = hf(idx).logits
    for rank, got in enumerate(run_ranks(tp, _tp_logits, str(out), idx)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"tp {tp} rank {rank}")


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _drop_tensor(directory: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    del state[name]
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), r"has no config\.json; give the folder save_pretrained wrote"),
        (lambda d: _edit_config(d, architectures=["GPT2ForSequenceClassification"]),
         r"architecture GPT2ForSequenceClassification is not supported; supported: GPT2LMHeadModel, LlamaForCausalLM"),
        (lambda d: _drop_tensor(d, "transformer.h.1.mlp.c_fc.weight"),
         r"do not match config\.json \(1 problem\(s\)\): transformer\.h\.1\.mlp\.c_fc\.weight missing"),
        (lambda d: _edit_config(d, n_inner=64),
         r"transformer\.h\.0\.mlp\.c_fc\.weight has shape \[32, 128\], config\.json says \[32, 64\]"),
        (lambda d: _edit_config(d, vocab_size=VOCAB + 8),
         r"transformer\.wte\.weight has shape \[317, 32\], config\.json says \[325, 32\]"),
        (lambda d: _edit_config(d, activation_function="relu"), r"activation_function='relu'"),
        (lambda d: (d / "tokenizer.json").unlink(), r"has no tokenizer: expected tokenizer\.json, or vocab\.json"),
    ],
    ids=["no-config", "architecture", "missing-tensor", "wrong-shape", "vocab-shape", "activation", "no-tokenizer"],
)
def test_bad_folders_are_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pretrained: Pretrained, damage: Any, message: str
) -> None:
    import re
    import shutil

    shutil.copytree(pretrained.directory, tmp_path / "hf")
    damage(tmp_path / "hf")
    code, _, err = cli(capsys, "model", "import", str(tmp_path / "hf"), "-o", str(tmp_path / "x.h5"))
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("hpcdist: error: ") and re.search(message, line), line
    assert not (tmp_path / "x.h5").exists() and not list(tmp_path.glob(".x.h5.*"))


def test_a_tokenizer_of_another_vocabulary_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pretrained: Pretrained
) -> None:
    import shutil

    shutil.copytree(pretrained.directory, tmp_path / "hf")
    make_pretrained(tmp_path / "small", vocab=300, n_layer=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((tmp_path / "small" / name).read_bytes())
    code, _, err = cli(capsys, "model", "import", str(tmp_path / "hf"), "-o", str(tmp_path / "x.h5"))
    assert code == 2
    assert "the tokenizer has 300 ids but the model's vocab_size is 317" in err, err

"""A tiny Hugging Face GPT-2 made here, nothing downloaded: a byte-level BPE tokenizer trained with
``tokenizers`` on local text, and a ``GPT2LMHeadModel`` with seeded random weights, both written
by ``save_pretrained`` into a folder, as a user's fine-tuned GPT-2 or DialoGPT would be."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import require_module, run_cli
from tests.support.train import write_corpus

VOCAB = 317  # BPE vocabulary of the test tokenizer, end-of-text included; odd like GPT-2's 50257 (TP pads it)


def make_pretrained(directory: Path, *, seed: int = 0, vocab: int = VOCAB, n_layer: int = 2, n_embd: int = 32,
                    n_head: int = 4, n_positions: int = 64, safetensors: bool = True,
                    tokenizer_json: bool = True) -> Any:
    """`directory` as save_pretrained writes it; the model (eval mode) for reference logits."""
    require_module("transformers")
    import tokenizers
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(directory.parent / f"{directory.name}-corpus.txt", words=3000, seed=seed)
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=vocab, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False)
    assert bpe.get_vocab_size() == vocab, "the corpus is too small for the test vocabulary"
    eot = bpe.token_to_id("<|endoftext|>")
    if tokenizer_json:
        fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                       bos_token="<|endoftext|>", unk_token="<|endoftext|>")
        fast.save_pretrained(str(directory))
    else:
        bpe.save_model(str(directory))  # vocab.json + merges.txt only, as older GPT-2 folders have
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     bos_token_id=eot, eos_token_id=eot)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # random biases and norms too, so a wrong mapping of any tensor shows
        for name, p in model.named_parameters():
            if name.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.normal_(0, 0.1).add_(1.0 if name.endswith("weight") else 0.0)
    model.save_pretrained(str(directory))
    if not safetensors:  # as the original GPT-2 files: pytorch_model.bin, no prefix, the causal masks stored
        (directory / "model.safetensors").unlink()
        state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        for i in range(n_layer):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n_positions, n_positions)).view(1, 1, n_positions, -1)
        torch.save(state, directory / "pytorch_model.bin")
    return model


@dataclass(frozen=True)
class Pretrained:
    directory: Path  # the save_pretrained folder
    checkpoint: Path  # what `hpcdist model import` made of it
    model: Any  # the transformers model, eval mode


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    """One tiny GPT-2 folder and its import through the real CLI, shared by the tests that only read them."""
    root = tmp_path_factory.mktemp("hf")
    model = make_pretrained(root / "hf")
    out = root / "gpt2.h5"
    result = run_cli("model", "import", str(root / "hf"), "-o", str(out))
    assert result.code == 0, result.text
    assert f"wrote {out}" in result.out and f"vocabulary {VOCAB}" in result.out
    return Pretrained(root / "hf", out, model)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`hpcdist ARGS...` in this process (transformers takes ~15 s to import in a fresh one)."""
    from hpcdist.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err

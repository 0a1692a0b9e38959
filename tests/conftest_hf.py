"""A tiny Hugging Face GPT-2 made here, nothing downloaded: a byte-level BPE tokenizer trained with
``tokenizers`` on local text, and a ``GPT2LMHeadModel`` with seeded random weights, both written
by ``save_pretrained`` into a folder, as a user's fine-tuned GPT-2 or DialoGPT would be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest_train import write_corpus

VOCAB = 320  # BPE vocabulary of the test tokenizer, end-of-text included; divisible by 1, 2 and 4


def make_pretrained(directory: Path, *, seed: int = 0, vocab: int = VOCAB, n_layer: int = 2, n_embd: int = 32,
                    n_head: int = 4, n_positions: int = 64, safetensors: bool = True,
                    tokenizer_json: bool = True) -> Any:
    """`directory` as save_pretrained writes it; the model (eval mode) for reference logits."""
    pytest.importorskip("transformers")
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
    model.save_pretrained(str(directory), safe_serialization=safetensors)
    return model

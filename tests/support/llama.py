"""Small LLaMA, Mistral and Qwen2 models made here, nothing downloaded: random weights in a
``save_pretrained`` folder (sharded or not, in float32 or bfloat16, in transformers 5's config form
or the older one) with a byte-level BPE tokenizer carrying LLaMA's special tokens and a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.support.train import write_corpus

VOCAB = 317
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"

# the shapes people run, small: GQA with Llama 3's rope scaling, a head_dim that is not d_model / heads and
# an untied head; Qwen2's q/k/v biases on a tied head; Mistral with a sliding window
VARIANTS: dict[str, dict[str, Any]] = {
    "llama3-gqa": dict(family="llama", num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       tie_word_embeddings=False, rope_theta=500000.0,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=64)),
    # Qwen2's vocabulary padded past the tokenizer's, as the published ones are
    "qwen2": dict(family="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  vocab_size=VOCAB + 3),
    "mistral": dict(family="mistral", num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    tie_word_embeddings=False, sliding_window=48),
    # Llama's attention_bias (q, k, v and o) and mlp_bias, on a tied head
    "llama-bias": dict(family="llama", num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                       mlp_bias=True, tie_word_embeddings=True),
}


def _tokenizer(directory: Path) -> None:
    """A byte-level BPE with LLaMA's special tokens and a chat template, saved as save_pretrained does."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    corpus = write_corpus(directory.parent / f"{directory.name}-corpus.txt", words=3000)
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=VOCAB, min_frequency=1, special_tokens=["<s>", "</s>", "<|endoftext|>"],
              show_progress=False)
    assert bpe.get_vocab_size() == VOCAB
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                   chat_template=TEMPLATE)
    fast.save_pretrained(str(directory))


def make_llama(directory: Path, variant: str, *, seed: int = 0, old_config: bool = False,
               shard: bool = False, dtype: torch.dtype = torch.float32) -> Any:
    """A save_pretrained folder of `variant` (random weights, spread so greedy choices are clear, saved
    in `dtype`); the model, in `dtype`."""
    import transformers

    spec = dict(VARIANTS[variant])
    family = spec.pop("family")
    rope = {"rope_type": "default", "rope_theta": spec.pop("rope_theta", 10000.0)}
    rope.update(spec.pop("rope_scaling", {}))
    cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    spec.setdefault("vocab_size", VOCAB)
    config = getattr(transformers, f"{cls}Config")(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_parameters=rope, bos_token_id=0, eos_token_id=1, initializer_range=0.1, **spec)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so a wrong mapping of any tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.normal_(0, 0.1).add_(1.0 if name.endswith("weight") else 0.0)
    model.to(dtype)
    directory.mkdir(parents=True)
    model.save_pretrained(str(directory), max_shard_size="100KB" if shard else "5GB")
    _tokenizer(directory)
    if old_config:  # as transformers before version 5 wrote it: rope_theta and rope_scaling
        raw = json.loads((directory / "config.json").read_text())
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = params if params["rope_type"] != "default" else None
        (directory / "config.json").write_text(json.dumps(raw))
    return model

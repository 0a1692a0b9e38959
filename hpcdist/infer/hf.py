"""The same weights in Hugging Face ``transformers.GPT2LMHeadModel``: the reference implementation.

Used by the greedy-equality test and the CPU benchmark. Only the GELU MLP maps onto GPT-2
(SwiGLU has no GPT-2 counterpart). GPT-2's Conv1D stores weights as (in, out), the transpose of
``nn.Linear``; everything else carries over by name. Needs the ``infer-ref`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hpcdist.model.config import GPTConfig

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_hf(cfg: GPTConfig, state: Mapping[str, Any]) -> Any:
    """A ``GPT2LMHeadModel`` in eval mode holding `state` (a GPT state dict, tensors or arrays)."""
    if cfg.mlp != "gelu":
        raise ValueError(f"only the gelu MLP maps onto GPT-2, not {cfg.mlp!r}")
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.d_hidden,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.ln_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=cfg.vocab_size - 1,
        eos_token_id=cfg.vocab_size - 1,
        pad_token_id=cfg.vocab_size - 1,
    )
    model = GPT2LMHeadModel(hf_cfg)
    mapped = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            continue
        t = torch.as_tensor(value).detach().clone().float()
        mapped[key] = t.t().contiguous() if key.endswith(CONV1D) else t
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    real_missing = [k for k in missing if k != "lm_head.weight" and not k.endswith(("attn.bias", "attn.masked_bias"))]
    if real_missing or unexpected:
        raise ValueError(f"weights do not map onto GPT-2: missing {real_missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_generate_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int, end_token: int) -> list[list[int]]:
    """Greedy continuations from transformers' own ``generate`` (left-padded batch), cut after the end token."""
    t_max = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t_max), end_token, dtype=torch.long)
    attn = torch.zeros(len(prompts), t_max, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t_max - len(p) :] = torch.tensor(p)
        attn[i, t_max - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=end_token,
        pad_token_id=end_token,
        use_cache=True,
    )
    result = []
    for row in out[:, t_max:].tolist():
        if end_token in row:
            row = row[: row.index(end_token) + 1]
        result.append(row)
    return result

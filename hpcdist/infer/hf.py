"""Greedy generation by Hugging Face ``transformers`` itself: the reference our generator is held to.

Used by the greedy-equality test and the CPU benchmark, on a model from ``hpcdist.model.hf.to_hf``
(the one owner of the GPT <-> GPT-2 mapping). Needs the ``infer-ref`` extra.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def hf_generate_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int, end_token: int) -> list[list[int]]:
    """Greedy continuations from transformers' own ``generate`` (left-padded batch), cut after the end token."""
    t_max = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t_max), end_token, dtype=torch.long)
    attn = torch.zeros(len(prompts), t_max, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t_max - len(p) :] = torch.tensor(p)
        attn[i, t_max - len(p) :] = 1
    out = model.generate(  # on the model's device: generate does not move its inputs there
        input_ids=ids.to(model.device),
        attention_mask=attn.to(model.device),
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

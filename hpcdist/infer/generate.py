"""Batched autoregressive generation with a KV cache, on a (tensor-parallel) GPT.

Prompts of different lengths share a batch by left padding: each row's positions start at 0
at its first real token, and the attention mask hides the padding (a padding position attends
to itself only, so no row of the mask is empty and nothing becomes NaN). One prefill pass fills
the cache with every prompt; each decode step feeds one token per row. Rows that produced the
end token are finished; the batch stops when all rows are finished or ``max_new_tokens`` is
reached.

Sampling is greedy (temperature 0) or from the softmax at a temperature, optionally restricted
to the top k tokens and/or the smallest set of tokens whose probability reaches top_p, drawn
from a seeded generator: the same seed, prompts and batch give the same tokens. Ranks of a
tensor-parallel group hold identical logits and identically seeded generators, so they draw the
same tokens without communicating.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hpcdist.errors import ConfigError
from hpcdist.infer.tp import TPGPT, additive_mask


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; temperature 0 is greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    end_token: int | None = None


@dataclass
class BatchOutput:
    """Generated tokens and timings of one batch; times in seconds from the batch's start."""

    tokens: list[list[int]]  # per request: the new tokens, the end token included when produced
    finish: list[str]  # per request: "end" (end token) or "length" (max_new_tokens)
    ttft_s: list[float]  # per request: time to first token
    total_s: list[float]  # per request: time to its last token
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # duration of each decode step
    elapsed_s: float = 0.0
    cache_bytes: int = 0  # the KV cache this batch allocated


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token per row of `logits` (batch, vocab)."""
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
        drop_sorted = before >= sampling.top_p  # the top token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(
    model: TPGPT, prompts: list[list[int]], sampling: Sampling, generator: torch.Generator | None = None
) -> BatchOutput:
    """Continue every prompt of the batch; see the module docstring for padding and stopping."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = model.device
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    t_max = int(lens.max())
    steps = sampling.max_new_tokens
    if t_max + steps - 1 > model.cfg.context:
        raise ValueError(
            f"a prompt of {t_max} tokens plus {steps} new tokens exceeds the context {model.cfg.context}"
        )
    why = model.cfg.check_length(t_max + steps - 1)  # the sliding window, where the model has one
    if why is not None:
        raise ConfigError(f"a prompt of {t_max} tokens plus {steps} new tokens: {why}")
    pad = t_max - lens
    ragged = bool((pad > 0).any())
    idx = torch.zeros(b, t_max, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        idx[i, t_max - len(p) :] = torch.tensor(p, dtype=torch.long)
    valid = torch.ones(b, t_max + steps, dtype=torch.bool, device=device)
    valid[:, :t_max] = torch.arange(t_max, device=device)[None, :] >= pad[:, None]
    positions = (torch.arange(t_max, device=device)[None, :] - pad[:, None]).clamp(min=0)
    step_positions = lens[:, None] + torch.arange(steps, device=device)[None, :]  # (b, steps)
    mask = step_bias = None
    if ragged:  # additive masks (0 or -inf), built once: a decode step only slices its columns
        causal = torch.ones(t_max, t_max, dtype=torch.bool, device=device).tril()
        eye = torch.eye(t_max, dtype=torch.bool, device=device)
        mask = additive_mask((causal[None] & valid[:, None, :t_max]) | eye[None], model.wte.weight.dtype)[:, None]
        step_bias = additive_mask(valid, model.wte.weight.dtype)[:, None, None]  # (b, 1, 1, t_max + steps)
    cache = model.new_cache(b, t_max + steps)

    out: list[list[int]] = [[] for _ in range(b)]
    finish = ["length"] * b
    last_s = [0.0] * b
    done = [False] * b
    step_s: list[float] = []
    _sync(device)
    t0 = time.perf_counter()
    real = valid[:, :t_max] if ragged else None
    logits = model(idx, positions=positions, mask=mask, cache=cache, last_only=True, real=real)[:, -1]
    nxt = sample(logits, sampling, generator)
    tokens = nxt.tolist()
    now = time.perf_counter() - t0
    prefill_s = ttft = now
    for step in range(steps):
        for i, tok in enumerate(tokens):
            if done[i]:
                continue
            out[i].append(tok)
            last_s[i] = now
            if sampling.end_token is not None and tok == sampling.end_token:
                done[i], finish[i] = True, "end"
        if all(done) or step == steps - 1:
            break
        before = now
        pos = step_positions[:, step : step + 1]
        step_mask = step_bias[..., : t_max + step + 1] if step_bias is not None else None
        logits = model(nxt[:, None], positions=pos, mask=step_mask, cache=cache, last_only=True)[:, -1]
        nxt = sample(logits, sampling, generator)
        tokens = nxt.tolist()
        now = time.perf_counter() - t0
        step_s.append(now - before)
    return BatchOutput(
        tokens=out,
        finish=finish,
        ttft_s=[ttft] * b,
        total_s=last_s,
        prefill_s=prefill_s,
        step_s=step_s,
        elapsed_s=now,
        cache_bytes=cache.nbytes,
    )

"""Rotary position embeddings (Su et al. 2021) as Hugging Face's LLaMA computes them, the one owner
for the training model and the tensor-parallel one.

The inverse frequencies are transformers' default ones, or Llama 3's scaled ones (low frequencies
divided by ``factor``, a smooth interpolation between the two wavelength bounds), in float32;
the rotation is the "rotate half" form (the first and second halves of a head are the pairs),
so Hugging Face's q/k weights are used as they are stored.
"""

from __future__ import annotations

import math

import torch

from hpcdist.model.config import GPTConfig


def inv_freq(cfg: GPTConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies of `cfg`'s rotary embedding."""
    dim = cfg.d_head
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return freq
    low_wavelen, high_wavelen = s.original_context / s.low_freq_factor, s.original_context / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (batch, 1, time, head_dim) for `positions` (batch, time), computed in float32."""
    angles = positions[..., None].float() * freq.float()
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` (batch, heads, time, head_dim) rotated by its positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

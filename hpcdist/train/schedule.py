"""Learning rate: the batch-size scaling rule, linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


def scaled_lr(lr: float, rule: str, global_batch: int, reference_batch: int) -> float:
    """The peak lr for `global_batch` sequences per step, from one tuned at `reference_batch`.

    ``linear`` (Goyal et al., 2017) multiplies by the batch ratio, ``sqrt`` (Krizhevsky, 2014;
    the usual choice for Adam) by its square root, ``none`` leaves it.
    """
    ratio = global_batch / reference_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown lr scaling rule {rule!r}; use none, linear or sqrt")


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

"""Latency and throughput figures of a generation run: percentiles and per-request numbers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation, as numpy); NaN for no values."""
    vals = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    return float(np.percentile(vals, q)) if vals.size else float("nan")


def per_token_s(ttft_s: float, total_s: float, new_tokens: int) -> float:
    """Mean time per token after the first (NaN when only one token was produced)."""
    return (total_s - ttft_s) / (new_tokens - 1) if new_tokens > 1 else float("nan")


def summarize(
    ttft_s: Sequence[float],
    total_s: Sequence[float],
    per_token: Sequence[float],
    step_s: Sequence[float],
    new_tokens: int,
    wall_s: float,
) -> dict[str, float]:
    """p50/p99 of time to first token, per-token latency, decode-step time and total latency,
    and overall tokens per second (all new tokens / the slowest rank's generation time)."""
    out: dict[str, float] = {}
    for name, vals in (("ttft", ttft_s), ("per_token", per_token), ("step", step_s), ("total", total_s)):
        out[f"{name}_p50_s"] = percentile(vals, 50)
        out[f"{name}_p99_s"] = percentile(vals, 99)
    out["new_tokens"] = float(new_tokens)
    out["wall_s"] = wall_s
    out["tokens_per_s"] = new_tokens / wall_s if wall_s > 0 else float("nan")
    return out

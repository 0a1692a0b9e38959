"""On-paper costs of tensor-parallel generation for a model shape: what crosses the network per token
and what each rank holds, from ``GPTConfig`` alone (pydantic only, no torch).

Per decode token, each block all-reduces its attention output and its MLP output, (d_model,)
each, and the vocabulary-parallel head all-gathers the logits; a ring all-reduce of B bytes sends
2 (tp - 1) / tp x B per rank (nccl-tests' bus factor, ``hpcdist.bench.bandwidth``). Each rank's KV
cache holds its KV heads (``n_kv_head / tp``, or one replicated when tp is a multiple of them) for
every layer. ``LLAMA_SIZES`` are the published shapes the README's table is computed for.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcdist.bench.bandwidth import bus_factor
from hpcdist.infer.shard_load import kv_heads_per_rank
from hpcdist.model.config import GPTConfig

_LLAMA = dict(mlp="swiglu", norm="rmsnorm", positions="rope", tied=False, attention_bias=False,
              attention_out_bias=False, mlp_bias=False, family="llama", ln_eps=1e-5)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, context=131072, rope_theta=500000.0, n_kv_head=8,
               rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192))
LLAMA_SIZES = {
    "llama-2-7b": GPTConfig.model_validate(dict(_LLAMA, vocab_size=32000, context=4096, n_layer=32, n_head=32,
                                                d_model=4096, d_ff=11008)),
    "llama-3.1-8b": GPTConfig.model_validate(dict(_LLAMA3, n_layer=32, n_head=32, d_model=4096, d_ff=14336)),
    "llama-3.1-70b": GPTConfig.model_validate(dict(_LLAMA3, n_layer=80, n_head=64, d_model=8192, d_ff=28672)),
}


@dataclass(frozen=True)
class TPCosts:
    """Per generated token (one sequence) at tensor-parallel degree `tp`, with `dtype_bytes` per value."""

    tp: int
    all_reduce_bytes: int  # the tensor one all-reduce sums: d_model values
    all_reduces: int  # per token: two per block
    all_reduce_sent_per_rank: float  # bytes each rank sends per token for them (ring: 2 (tp-1)/tp x size)
    all_gather_bytes: int  # the logits the head assembles per token (padded vocabulary)
    kv_heads_per_rank: int
    kv_cache_bytes_per_token: int  # per rank: keys and values of every layer
    weight_bytes_per_rank: int  # split tensors / tp, embeddings and norms whole


def tp_costs(cfg: GPTConfig, tp: int, dtype_bytes: int = 2) -> TPCosts:
    """The on-paper costs of `cfg` at degree `tp` (see the module docstring)."""
    d, hd = cfg.d_model, cfg.d_head
    kv = kv_heads_per_rank(cfg, tp)
    ar = d * dtype_bytes
    n_ar = 2 * cfg.n_layer
    attn_local = d * cfg.n_head * hd // tp + 2 * d * kv * hd + cfg.n_head * hd * d // tp  # q, k+v, out
    mlp_local = 3 * d * cfg.d_hidden // tp if cfg.mlp == "swiglu" else 2 * d * cfg.d_hidden // tp
    embed = cfg.vocab_size * d + (0 if cfg.tied else -(-cfg.vocab_size // tp) * d)
    weights = (cfg.n_layer * (attn_local + mlp_local + 2 * d) + embed + d) * dtype_bytes
    return TPCosts(
        tp=tp, all_reduce_bytes=ar, all_reduces=n_ar,
        all_reduce_sent_per_rank=n_ar * ar * bus_factor("all_reduce", tp) if tp > 1 else 0.0,
        all_gather_bytes=-(-cfg.vocab_size // tp) * tp * dtype_bytes,
        kv_heads_per_rank=kv, kv_cache_bytes_per_token=2 * cfg.n_layer * kv * hd * dtype_bytes,
        weight_bytes_per_rank=weights,
    )

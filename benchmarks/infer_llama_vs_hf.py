"""hpcdist KV-cache generation against transformers' ``LlamaForCausalLM.generate`` on the same small
Llama-shaped model: grouped-query attention (8 query heads, 2 KV heads), Llama 3 rope scaling,
RMSNorm, SwiGLU, an untied head; random weights, nothing downloaded.

The same measurement as ``infer_vs_hf.py`` (its ``compare``): a batch of 8 left-padded prompts of
16-40 tokens, 64 new tokens, greedy, the same torch thread count, medians of --repeat runs after a
warm-up, and whether the tokens are identical. The load average is printed before and after, as
other processes share this machine's memory bandwidth.

    python benchmarks/infer_llama_vs_hf.py [--layers 6 --d-model 384 --heads 8 --kv-heads 2 --repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from infer_vs_hf import compare  # noqa: E402

from hpcdist.model.config import GPTConfig, RopeScaling  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(
        context=256, n_layer=args.layers, n_head=args.heads, n_kv_head=args.kv_heads, d_model=args.d_model,
        d_ff=args.d_ff, mlp="swiglu", ln_eps=1e-5, family="llama", norm="rmsnorm", positions="rope",
        rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                      original_context=64),
        tied=False, attention_bias=False, attention_out_bias=False, mlp_bias=False,
    )
    load_before = os.getloadavg()
    r = compare(cfg, args.batch, args.new, args.repeat)
    load_after = os.getloadavg()
    v = r["versions"]
    print(f"model: Llama-shaped, {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads ({cfg.n_kv} KV, "
          f"head_dim {cfg.d_head}), d_ff {cfg.d_hidden}, untied head, llama3 rope; {r['params_m']:.1f}M params; "
          f"batch {args.batch} ragged prompts (16-40 tokens), {args.new} new tokens, {args.threads} threads; "
          f"torch {v['torch']}, transformers {v['transformers']}")
    for name, s in r["seconds"].items():
        print(f"{name:>13}: median {s:.3f} s over {args.repeat} runs, {r['tokens_per_s'][name]:.1f} tokens/s")
    print(f"speed ratio transformers/hpcdist: {r['ratio']:.2f}x (>1: hpcdist faster)")
    print(f"greedy tokens identical: {r['identical']}")
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in load_after) + f" on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()

"""Tensor-parallel speedup: the same model and batch generated at tp=1 and tp=2 on this machine.

Each rank gets one thread (the CPU stand-in for one GPU per rank), so tp=2 uses twice the
compute with two all-reduces per block and one all-gather per token over gloo. Prints median
generation times and the ratio t(tp=1) / t(tp=2); checks both produce the same greedy tokens;
prints the share of the generation rank 0 spent in collectives (waiting for the peer included)
and the load average. ``--shape llama`` runs a Llama-shaped model (RMSNorm, rope, SwiGLU, a
quarter of the heads as KV heads, untied head); ``--paper`` prints the on-paper figures of
published Llama sizes at tp 4 and 8 (``hpcdist.infer.sizing``) and exits.

    python benchmarks/infer_tp_speedup.py [--shape llama] [--layers 4 --d-model 1024 --heads 16 --batch 8 --new 32]
    python benchmarks/infer_tp_speedup.py --paper
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _ranks import run_ranks  # noqa: E402

from hpcdist.infer.generate import Sampling, generate  # noqa: E402
from hpcdist.infer.shard_load import shard_state  # noqa: E402
from hpcdist.infer.tp import TPGPT, TPGroup  # noqa: E402
from hpcdist.model.gpt import GPT, GPTConfig  # noqa: E402


class _Timed:
    """A TPGroup that adds up the seconds spent in its collectives."""

    def __init__(self, inner: TPGroup) -> None:
        self.inner, self.rank, self.size, self.group = inner, inner.rank, inner.size, inner.group
        self.seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        y = self.inner.all_reduce(x)
        self.seconds += time.perf_counter() - t
        return y

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        y = self.inner.all_gather_last(x)
        self.seconds += time.perf_counter() - t
        return y


def _rank(rank: int, world: int, cfg: GPTConfig, prompts: list[list[int]], new: int, repeat: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(0)
    full = GPT(cfg).state_dict()
    model = TPGPT(cfg, TPGroup(rank, world, None))
    model.load_shard(shard_state(full, cfg, rank, world))
    del full
    timed = _Timed(model.tp)
    model.tp = timed  # type: ignore[assignment]
    times, comm, tokens = [], [], None
    for i in range(repeat + 1):
        dist.barrier()
        timed.seconds = 0.0
        t = time.perf_counter()
        tokens = generate(model, prompts, Sampling(max_new_tokens=new)).tokens
        if i:
            times.append(time.perf_counter() - t)
            comm.append(timed.seconds)
    return {"times": times, "comm": comm, "tokens": tokens}


def _paper() -> None:
    from hpcdist.infer.sizing import LLAMA_SIZES, tp_costs

    print("bf16, per generated token of one sequence; all-reduce: 2 per layer of d_model values (ring: each rank "
          "sends 2(tp-1)/tp of it); KV cache per rank per token; weights per rank")
    for name, cfg in LLAMA_SIZES.items():
        for tp in (4, 8):
            c = tp_costs(cfg, tp)
            print(f"{name:>14} tp={tp}: {c.all_reduces} all-reduces of {c.all_reduce_bytes / 1024:.0f} KiB, "
                  f"{c.all_reduce_sent_per_rank / 2**20:.2f} MiB sent per rank; logits all-gather "
                  f"{c.all_gather_bytes / 1024:.0f} KiB; {c.kv_heads_per_rank} KV head(s) per rank, KV cache "
                  f"{c.kv_cache_bytes_per_token / 1024:.0f} KiB per token per rank; weights "
                  f"{c.weight_bytes_per_rank / 2**30:.2f} GiB per rank")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shape", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--paper", action="store_true", help="print the on-paper figures of published Llama sizes")
    args = ap.parse_args()
    if args.paper:
        _paper()
        return
    cfg = GPTConfig(context=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    if args.shape == "llama":
        cfg = GPTConfig(context=256, n_layer=args.layers, n_head=args.heads, n_kv_head=max(1, args.heads // 4),
                        d_model=args.d_model, d_ff=args.d_model * 8 // 3 // 64 * 64, mlp="swiglu", family="llama",
                        norm="rmsnorm", positions="rope", rope_theta=500000.0, tied=False, attention_bias=False,
                        attention_out_bias=False, mlp_bias=False)
    load_before = os.getloadavg()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    med = {}
    toks = {}
    share = 0.0
    for tp in (1, 2):
        outs = run_ranks(tp, _rank, cfg, prompts, args.new, args.repeat, threads=1)
        med[tp] = statistics.median(max(o["times"][i] for o in outs) for i in range(args.repeat))
        toks[tp] = outs[0]["tokens"]
        if tp > 1:
            share = statistics.median(c / t for c, t in zip(outs[0]["comm"], outs[0]["times"], strict=True))
        n = sum(len(t) for t in toks[tp])
        print(f"tp={tp}: median {med[tp]:.3f} s, {n / med[tp]:.1f} tokens/s")
    print(f"model ({args.shape}) {cfg.num_params() / 1e6:.1f}M params, {cfg.n_head} heads ({cfg.n_kv} KV), batch "
          f"{args.batch} x {args.prompt} prompt tokens, {args.new} new tokens, 1 thread per rank")
    print(f"tp speedup t(1)/t(2): {med[1] / med[2]:.2f}x; same greedy tokens: {toks[1] == toks[2]}")
    print(f"tp=2: {100 * share:.0f}% of rank 0's generation time in collectives (waiting for the peer included)")
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()

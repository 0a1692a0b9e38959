"""Tensor-parallel speedup: the same model and batch generated at tp=1 and tp=2 on this machine.

Each rank gets one thread (the CPU stand-in for one GPU per rank), so tp=2 uses twice the
compute with two all-reduces per block and one all-gather per token over gloo. Prints median
generation times and the ratio t(tp=1) / t(tp=2); checks both produce the same greedy tokens.

    python benchmarks/infer_tp_speedup.py [--layers 4 --d-model 1024 --heads 16 --batch 8 --new 32]
"""

from __future__ import annotations

import argparse
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


def _rank(rank: int, world: int, cfg: GPTConfig, prompts: list[list[int]], new: int, repeat: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(0)
    full = {k: v for k, v in GPT(cfg).state_dict().items() if k != "lm_head.weight"}
    model = TPGPT(cfg, TPGroup(rank, world, None))
    model.load_shard(shard_state(full, cfg, rank, world))
    del full
    times, tokens = [], None
    for i in range(repeat + 1):
        dist.barrier()
        t = time.perf_counter()
        tokens = generate(model, prompts, Sampling(max_new_tokens=new)).tokens
        if i:
            times.append(time.perf_counter() - t)
    return {"times": times, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cfg = GPTConfig(context=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    med = {}
    toks = {}
    for tp in (1, 2):
        outs = run_ranks(tp, _rank, cfg, prompts, args.new, args.repeat, threads=1)
        med[tp] = statistics.median(max(o["times"][i] for o in outs) for i in range(args.repeat))
        toks[tp] = outs[0]["tokens"]
        n = sum(len(t) for t in toks[tp])
        print(f"tp={tp}: median {med[tp]:.3f} s, {n / med[tp]:.1f} tokens/s")
    print(f"model {cfg.num_params() / 1e6:.1f}M params, batch {args.batch} x {args.prompt} prompt tokens, "
          f"{args.new} new tokens, 1 thread per rank")
    print(f"tp speedup t(1)/t(2): {med[1] / med[2]:.2f}x; same greedy tokens: {toks[1] == toks[2]}")


if __name__ == "__main__":
    main()

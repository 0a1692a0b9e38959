"""hpcdist KV-cache generation against Hugging Face transformers GPT-2, same weights, this CPU.

Both generate greedily for the same left-padded batch of prompts of different lengths, the
same number of new tokens (no end token), with the same torch thread count; medians of
--repeat runs after one warm-up. Prints both medians, the ratio (HF time / hpcdist time; > 1
means hpcdist is faster) and whether the greedy tokens are identical.

    python benchmarks/infer_vs_hf.py [--layers 6 --d-model 384 --heads 6 --batch 8 --new 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hpcdist.infer.generate import Sampling, generate
from hpcdist.infer.hf import hf_generate_greedy, to_hf
from hpcdist.infer.tp import TPGPT
from hpcdist.model.gpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(context=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():  # spread the logits so greedy choices are not near-ties
        for p in model.parameters():
            p.mul_(4.0)
    state = model.state_dict()
    ours = TPGPT(cfg)
    ours.load_shard({k: v for k, v in state.items() if k != "lm_head.weight"})
    hf = to_hf(cfg, state)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (16 + 8 * (i % 4),), generator=gen).tolist() for i in range(args.batch)]
    no_end = cfg.vocab_size - 1  # the end token; a random model rarely emits it, and both stop alike

    def run_ours() -> list[list[int]]:
        return generate(ours, prompts, Sampling(max_new_tokens=args.new, end_token=no_end)).tokens

    def run_hf() -> list[list[int]]:
        return hf_generate_greedy(hf, prompts, args.new, no_end)

    times: dict[str, list[float]] = {"hpcdist": [], "transformers": []}
    outs = {}
    for name, fn in (("hpcdist", run_ours), ("transformers", run_hf)) * 1:
        outs[name] = fn()  # warm-up
    for _ in range(args.repeat):
        for name, fn in (("hpcdist", run_ours), ("transformers", run_hf)):
            t = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t)
    new_tokens = sum(len(t) for t in outs["hpcdist"])
    print(f"model: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, "
          f"{cfg.num_params() / 1e6:.1f}M params; batch {args.batch} ragged prompts (16-40 tokens), "
          f"{args.new} new tokens, {args.threads} threads, torch {torch.__version__}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>13}: median {med:.3f} s over {len(ts)} runs, {new_tokens / med:.1f} tokens/s")
    ratio = statistics.median(times["transformers"]) / statistics.median(times["hpcdist"])
    print(f"speed ratio transformers/hpcdist: {ratio:.2f}x (>1: hpcdist faster)")
    print(f"greedy tokens identical: {outs['hpcdist'] == outs['transformers']}")


if __name__ == "__main__":
    main()

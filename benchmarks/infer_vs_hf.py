"""hpcdist KV-cache generation against Hugging Face transformers GPT-2, same weights, same device
(``compare`` takes any family: ``infer_llama_vs_hf.py`` runs it on a Llama-shaped model).

Both generate greedily for the same left-padded batch of prompts of different lengths, the
same number of new tokens (no end token), with the same torch thread count; medians of
--repeat runs after one warm-up. Prints both medians, the ratio (HF time / hpcdist time; > 1
means hpcdist is faster), whether the greedy tokens are identical, and the versions.
``benchmarks/gpu_check.py`` calls ``compare`` for the same figures on a GPU.

    python benchmarks/infer_vs_hf.py [--layers 6 --d-model 384 --heads 6 --batch 8 --new 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcdist.infer.generate import Sampling, generate  # noqa: E402
from hpcdist.infer.hf import hf_generate_greedy  # noqa: E402
from hpcdist.infer.tp import TPGPT  # noqa: E402
from hpcdist.model.gpt import GPT, GPTConfig  # noqa: E402
from hpcdist.model.hf import to_hf  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(cfg: GPTConfig, batch: int, new: int, repeat: int, device: str = "cpu") -> dict[str, Any]:
    """Time both generators on one random model and batch; the figures `main` prints."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():  # spread the logits so greedy choices are not near-ties
        for p in model.parameters():
            p.mul_(4.0)
    state = model.state_dict()
    ours = TPGPT(cfg, device=dev)
    ours.load_shard(state)  # a tied head's lm_head.weight is not among TPGPT's tensors and is left aside
    hf = to_hf(cfg, state).to(dev)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (16 + 8 * (i % 4),), generator=gen).tolist() for i in range(batch)]
    no_end = cfg.vocab_size - 1  # the end token; a random model rarely emits it, and both stop alike

    def run_ours() -> list[list[int]]:
        return generate(ours, prompts, Sampling(max_new_tokens=new, end_token=no_end)).tokens

    def run_hf() -> list[list[int]]:
        return hf_generate_greedy(hf, prompts, new, no_end)

    sides = (("hpcdist", run_ours), ("transformers", run_hf))
    times: dict[str, list[float]] = {"hpcdist": [], "transformers": []}
    outs = {name: fn() for name, fn in sides}  # warm-up
    for _ in range(repeat):
        for name, fn in sides:
            _sync(dev)
            t = time.perf_counter()
            outs[name] = fn()
            _sync(dev)
            times[name].append(time.perf_counter() - t)
    import transformers

    new_tokens = sum(len(t) for t in outs["hpcdist"])
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "params_m": cfg.num_params() / 1e6,
        "new_tokens": new_tokens,
        "seconds": med,
        "tokens_per_s": {name: new_tokens / s for name, s in med.items()},
        "ratio": med["transformers"] / med["hpcdist"],
        "identical": outs["hpcdist"] == outs["transformers"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


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
    r = compare(cfg, args.batch, args.new, args.repeat)
    v = r["versions"]
    print(f"model: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, {r['params_m']:.1f}M params; "
          f"batch {args.batch} ragged prompts (16-40 tokens), {args.new} new tokens, {args.threads} threads; "
          f"torch {v['torch']}, transformers {v['transformers']}")
    for name, s in r["seconds"].items():
        print(f"{name:>13}: median {s:.3f} s over {args.repeat} runs, {r['tokens_per_s'][name]:.1f} tokens/s")
    print(f"speed ratio transformers/hpcdist: {r['ratio']:.2f}x (>1: hpcdist faster)")
    print(f"greedy tokens identical: {r['identical']}")


if __name__ == "__main__":
    main()

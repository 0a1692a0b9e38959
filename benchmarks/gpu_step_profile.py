"""Where one compiled train_gpt step spends the GPU's time: what holds MFU below its goal.

    PYTHONPATH=. python3 benchmarks/gpu_step_profile.py            # GPT-2 small, micro 16, bf16

The step is train_gpt's on one GPU, without the job around it: hpcdist's ``GPT`` with its blocks
and head compiled (``GPT.compile_parts``, as ``params.compile: auto`` does on CUDA), TF32, a fused
AdamW, bf16 autocast, gradient clipping, one random batch. It prints the first step's time (the
compilation), tokens/s and MFU (6N + 6LTD per token, the GPU's bf16 peak) over timed steps, then
``torch.profiler``'s kernels over a few more, in classes (`kernel_class`): how much of a step the
GPU was busy, and which kernels took the time. Without a GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

MATMUL = ("gemm", "nvjet", "sm90", "cutlass", "xmma", "cublas")
ATTENTION = ("flash", "fmha", "attention", "sdpa")
OPTIMIZER = ("multi_tensor", "adam", "foreach")


def kernel_class(name: str) -> str:
    """A CUDA kernel's class by its name: matmul (cuBLAS, CUTLASS, nvjet), attention (flash, cuDNN
    SDPA), optimizer (the fused or foreach AdamW), triton (inductor's fused pointwise kernels,
    norms and the loss) or other."""
    n = name.lower()
    if any(k in n for k in ATTENTION):
        return "attention"
    if any(k in n for k in MATMUL):
        return "matmul"
    if any(k in n for k in OPTIMIZER):
        return "optimizer"
    return "triton (fused pointwise, norms, loss)" if "triton" in n else "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after 10 untimed")
    ap.add_argument("--profiled", type=int, default=5, help="steps under the profiler")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_judges import mfu
    from benchmarks.gpu_train_judges import issue_flops_per_token, percent
    from hpcdist.model.config import GPTConfig
    from hpcdist.model.gpt import GPT
    from hpcdist.train.metrics import peak_tflops

    if not torch.cuda.is_available():
        print("gpu_step_profile: no GPU")
        return 2
    torch.set_float32_matmul_precision("high")
    cfg = GPTConfig(vocab_size=50257, context=1024, n_layer=12, n_head=12, d_model=768)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    model.compile_parts()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batch = torch.randint(0, cfg.vocab_size, (args.micro, cfg.context + 1), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    print(f"first step {time.perf_counter() - t:.1f} s (compiling)")
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) / args.steps * 1e3
    tokens_s = args.micro * cfg.context / step_ms * 1e3
    peak = peak_tflops(torch.cuda.get_device_name(0), "bf16")
    util = mfu(issue_flops_per_token(cfg.model_dump()), tokens_s, peak)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, micro {args.micro}: {step_ms:.1f} ms a step, "
          f"{tokens_s:,.0f} tokens/s, MFU (6N + 6LTD, {peak} TFLOP/s) {percent(util)}")

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profiled):
            step()
        torch.cuda.synchronize()
    classes: collections.Counter[str] = collections.Counter()
    kernels: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us > 0:
            classes[kernel_class(event.key)] += us
            kernels[event.key[:90]] += us
    per_step = {k: v / args.profiled / 1e3 for k, v in classes.items()}  # ms
    busy = sum(per_step.values())
    print(f"GPU busy {busy:.1f} ms of {step_ms:.1f} ms a step ({busy / step_ms:.0%})")
    for name, ms in sorted(per_step.items(), key=lambda kv: -kv[1]):
        print(f"  {name}: {ms:.1f} ms ({ms / busy:.0%})")
    for name, us in kernels.most_common(12):
        print(f"    {us / args.profiled / 1e3:6.2f} ms  {name}")
    if per_step.get("matmul"):
        print(f"matmuls at {6 * cfg.num_params() * args.micro * cfg.context / (per_step['matmul'] / 1e3) / 1e12:.0f} "
              f"TFLOP/s (6N a token over their time)")
    return 0


if __name__ == "__main__":
    root = str(Path(__file__).resolve().parents[1])  # benchmarks.gpu_judges, hpcdist
    if root not in sys.path:
        sys.path.insert(0, root)
    sys.exit(main())

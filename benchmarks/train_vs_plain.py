"""train_gpt against the plain PyTorch loop a user could write in 60 lines: tokens/s, same model, same batch.

    PYTHONPATH=. python benchmarks/train_vs_plain.py --repeat 3        # CPU, eager both sides

The plain side is the model written plainly below (GPT-2's shape: learned positions, LayerNorm,
causal SDPA, tanh GELU, a tied head), AdamW (fused on CUDA, foreach on CPU), random windows of
the same token file, the loss read only every `--window` steps; the hpcdist side is a real
``hpcdist submit jobs/train_gpt.yaml --site local --wait`` of one rank with the same shape, batch,
optimizer and precision. Both run with the same number of threads, one after the other,
alternating ``--repeat`` times so drift on a shared machine hits both. Each figure is the median
over windows of `--window` steps (train_gpt's own rows, which it times per ``log_every`` window),
the first window left out (warm-up; with compiling, the compilation). The ratio is
train_gpt / plain; the issue's target on CPU is >= 0.95.

``--plain-only --json FILE`` runs the plain side alone and writes its figures (the GPU check's
reference row submits this script so: ``--device cuda --compile --precision bf16`` GPT-2 small).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMALL = {"n_layer": 2, "n_head": 4, "d_model": 128, "context": 128}


def plain_run(tokens: Path, model: dict[str, int], micro: int, steps: int, window: int, device: str = "cpu",
              precision: str = "fp32", compile: bool = False, lr: float = 6e-4) -> list[float]:
    """The plain loop: tokens/s of each window of `window` steps (host and device in step at its end)."""
    import h5py
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    with h5py.File(tokens, "r") as f:
        data = torch.from_numpy(f["train"][()].astype(np.int64))
        vocab = int(model.get("vocab_size", f.attrs["vocab_size"]))
    d, h, ctx = model["d_model"], model["n_head"], model["context"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(d, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.h = nn.ModuleList(Block() for _ in range(model["n_layer"]))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied head
            return F.cross_entropy(logits.float().view(-1, vocab), targets.reshape(-1))

    torch.manual_seed(0)
    net = Plain().to(device)
    for p in net.parameters():
        nn.init.normal_(p, 0.0, 0.02) if p.dim() == 2 else None
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    fused = {"fused": True} if device.startswith("cuda") else {"foreach": True}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), **fused)
    step_fn = torch.compile(net) if compile else net
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    rates: list[float] = []
    t0, losses = time.perf_counter(), []
    for step in range(1, steps + 1):
        starts = torch.randint(len(data) - ctx - 1, (micro,))
        batch = torch.stack([data[s: s + ctx + 1] for s in starts.tolist()]).to(device, non_blocking=True)
        with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = step_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % window == 0:
            torch.stack(losses).tolist()  # the host waits here, once a window
            now = time.perf_counter()
            rates.append(window * micro * ctx / (now - t0))
            t0, losses = now, []
    return rates


def hpcdist_run(work: Path, tokens: Path, model: dict[str, int], micro: int, steps: int, window: int,
                threads: int, precision: str = "fp32", compile: str = "false",
                sets: tuple[str, ...] = ()) -> list[float]:
    """train_gpt through ``hpcdist submit --site local --wait``: tokens/s of each `window` of steps
    (its rows), the first window (warm-up, compilation) left out."""
    from benchmarks.gpu_jobs import window_rates

    shape = "{" + ", ".join(f"{k}: {v}" for k, v in model.items()) + "}"
    args = ["submit", "jobs/train_gpt.yaml", "--site", "local", "--wait",
            *[f"--set=site.storage.{k}={work / k}" for k in ("results", "checkpoints", "scratch", "logs")],
            *[f"--set={s}" for s in (
                "resources.tasks_per_node=1", f"params.data={tokens}", f"params.model={shape}", f"params.steps={steps}",
                f"params.batch.micro={micro}", "params.batch.accum=1", "params.optim.warmup_steps=1",
                f"params.precision={precision}", f"params.compile={compile}", "params.eval.every=0",
                f"params.checkpoint.every={steps}", f"params.log_every={window}",
                f"env={{OMP_NUM_THREADS: '{threads}'}}", "timeout_s=600", *sets)]]
    proc = subprocess.run([sys.executable, "-m", "hpcdist.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    match = re.search(r"result: (\S+)", proc.stdout)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"train_gpt failed:\n{proc.stdout}\n{proc.stderr}")
    return list(window_rates(Path(match.group(1)), window).values())


def prepare_tokens(work: Path) -> Path:
    """A token file from this repository's own sources (bytes tokenizer, nothing downloaded)."""
    texts = sorted(str(p) for p in REPO.glob("hpcdist/**/*.py"))
    out = work / "tokens.h5"
    subprocess.run([sys.executable, "-m", "hpcdist.cli", "data", "prepare", *texts, "-o", str(out)], check=True,
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=10, help="steps per timed window (train_gpt's log_every)")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=json.loads, default=SMALL,
                    help="JSON: n_layer, n_head, d_model, context (vocab_size: the token file's unless given)")
    ap.add_argument("--tokens", type=Path, help="a token file (default: made from this repository's sources)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--compile", action="store_true", help="torch.compile the plain model (and train_gpt's)")
    ap.add_argument("--plain-only", action="store_true", help="only the plain loop (the GPU check's reference)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="train-vs-plain-") as tmp:
        work = Path(tmp)
        tokens = args.tokens or prepare_tokens(work)
        plain: list[float] = []
        ours: list[float] = []
        for i in range(args.repeat):
            plain += plain_run(tokens, args.model, args.micro, args.steps, args.window, args.device, args.precision,
                               args.compile)[1:]
            if not args.plain_only:
                ours += hpcdist_run(work / f"run{i}", tokens, args.model, args.micro, args.steps, args.window,
                                    args.threads, args.precision, str(args.compile).lower())
    out: dict[str, Any] = {"model": args.model, "micro": args.micro, "steps": args.steps, "window": args.window,
                           "device": args.device, "precision": args.precision, "compile": args.compile,
                           "threads": args.threads, "torch": torch.__version__,
                           "plain_tokens_per_s": statistics.median(plain), "plain_windows": len(plain),
                           "plain_window_rates": [round(x) for x in plain]}
    print(f"plain PyTorch loop: {out['plain_tokens_per_s']:,.0f} tokens/s (median of {len(plain)} windows)")
    if ours:
        out["train_gpt_tokens_per_s"] = statistics.median(ours)
        out["ratio"] = out["train_gpt_tokens_per_s"] / out["plain_tokens_per_s"]
        print(f"train_gpt:          {out['train_gpt_tokens_per_s']:,.0f} tokens/s (median of {len(ours)} windows)")
        print(f"train_gpt / plain:  {out['ratio']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())

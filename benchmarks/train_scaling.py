"""Data-parallel scaling of train_gpt: tokens per second at 1 and 2 ranks, one thread per rank.

Each configuration is a real `hpcdist submit jobs/train_gpt.yaml` on the given site with the
same per-rank batch (weak scaling); the figure is the median step throughput from the job's
result file (the first step excluded). Runs alternate 1, 2, 1, 2 ... so drift hits both.
Efficiency = tokens/s at 2 ranks / (2 x tokens/s at 1 rank).

    PYTHONPATH=. python benchmarks/train_scaling.py --repeat 3
    PYTHONPATH=. python benchmarks/train_scaling.py --site local-slurm --nodes 2   # 1 rank per node
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hpcdist.store.results import read_attrs

REPO = Path(__file__).resolve().parents[1]


def prepare_tokens(work: Path) -> Path:
    """A token file from this repository's own sources and docs (nothing downloaded)."""
    texts = sorted(str(p) for p in REPO.glob("hpcdist/**/*.py")) + sorted(str(p) for p in REPO.glob("*.md"))
    out = work / "tokens.h5"
    subprocess.run([sys.executable, "-m", "hpcdist.cli", "data", "prepare", *texts, "-o", str(out)],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    return out


def run(work: Path, tokens: Path, ranks: int, args: argparse.Namespace, i: int) -> float:
    root = work / f"r{ranks}-{i}"
    sets = [f"site.storage.{k}={root / k}" for k in ("results", "checkpoints", "scratch", "logs")]
    layout = (["resources.nodes=2", "resources.tasks_per_node=1"] if ranks == 2 else
              ["resources.nodes=1", "resources.tasks_per_node=1"]) if args.nodes == 2 else [
        f"resources.tasks_per_node={ranks}"]
    sets += layout + [
        f"params.data={tokens}", f"params.steps={args.steps}", "params.optim.warmup_steps=1",
        f"params.model={{n_layer: {args.n_layer}, n_head: 4, d_model: {args.d_model}, context: {args.context}}}",
        f"params.batch.micro={args.micro}", "params.batch.accum=1", f"params.precision={args.precision}",
        "params.eval.every=0", f"params.checkpoint.every={args.steps}", "params.log_every=1000",
    ]
    cmd = [sys.executable, "-m", "hpcdist.cli", "submit", "jobs/train_gpt.yaml", "--site", args.site, "--wait"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run with {ranks} rank(s) failed:\n{proc.stdout}\n{proc.stderr}")
    match = re.search(r"result: (\S+)", proc.stdout)
    assert match, proc.stdout
    return float(read_attrs(Path(match.group(1)))["tokens_per_s_median"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", default="local")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: one rank per node (Slurm)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (shared storage for Slurm)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="scaling-", dir=args.dir))
    try:
        tokens = prepare_tokens(work)
        load_before = os.getloadavg()[0]
        tps: dict[int, list[float]] = {1: [], 2: []}
        for i in range(args.repeat):
            for ranks in (1, 2):
                tps[ranks].append(run(work, tokens, ranks, args, i))
                print(f"  run {i}: {ranks} rank(s) {tps[ranks][-1]:,.0f} tokens/s", flush=True)
        one, two = statistics.median(tps[1]), statistics.median(tps[2])
        print(f"# train_gpt weak scaling on site {args.site}: GPT {args.n_layer}x{args.d_model}, context "
              f"{args.context}, micro-batch {args.micro} per rank, {args.precision}, {args.steps} steps, "
              f"{args.repeat} repeats, 1 thread per rank; {os.cpu_count()} CPUs, load average "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
              f"(other work on the machine skews the 2-rank figure)")
        print(f"{'ranks':>5}{'median tokens/s':>18}{'speed-up':>10}{'efficiency':>12}")
        print(f"{1:>5}{one:>18,.0f}{1.0:>10.2f}{1.0:>12.2f}")
        print(f"{2:>5}{two:>18,.0f}{two / one:>10.2f}{two / (2 * one):>12.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

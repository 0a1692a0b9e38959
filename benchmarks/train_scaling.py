"""Data-parallel scaling of train_gpt: tokens per second at 1 and 2 ranks, one thread per rank.

Each configuration is a real `hpcdist submit jobs/train_gpt.yaml` on the given site with the
same per-rank batch (weak scaling); the figure is the median step throughput from the job's
result file (the first step excluded). Runs alternate 1, 2, 1, 2 ... so drift hits both.
Efficiency = tokens/s at 2 ranks / (2 x tokens/s at 1 rank).

    PYTHONPATH=. python benchmarks/train_scaling.py --repeat 3
    PYTHONPATH=. python benchmarks/train_scaling.py --site local-slurm --nodes 2   # 1 rank per node
    PYTHONPATH=. python benchmarks/train_scaling.py --profile     # where a 2-rank step's time goes

``--profile`` answers why the speed-up is what it is: the same model and per-rank batch, in
processes of its own (gloo, one thread each), timing alternately a DDP step with its gradient
all-reduce and the same step under ``no_sync`` (compute only), plus a bare all_reduce of the
gradient's bytes; at 1 rank and at 2. Communication's share of a step is (synced - compute) /
synced; the compute-only step at 2 ranks against 1 rank shows what sharing the cores costs.
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


def _profile_rank(rank: int, world: int, store_path: str, args: argparse.Namespace, out: dict[int, dict[str, float]],
                  ) -> None:
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpcdist.model.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=4, d_model=args.d_model, context=args.context, vocab_size=257)
    torch.manual_seed(0)
    ddp = DDP(GPT(cfg))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    x = torch.randint(0, 257, (args.micro, args.context))

    def step(sync: bool) -> float:
        t = time.perf_counter()
        with ddp.no_sync() if not sync else torch.enable_grad():
            loss = F.cross_entropy(ddp(x).view(-1, cfg.vocab_size), x.view(-1))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    grad = torch.zeros(sum(p.numel() for p in ddp.parameters()))
    grad.fill_(1.0)

    def reduce() -> float:
        t = time.perf_counter()
        dist.all_reduce(grad)
        return time.perf_counter() - t

    for _ in range(3):
        step(True)
    synced: list[float] = []
    compute: list[float] = []
    comm: list[float] = []
    for i in range(args.steps):
        dist.barrier()
        for sync in ((True, False) if i % 2 == 0 else (False, True)):
            (synced if sync else compute).append(step(sync))
        dist.barrier()
        comm.append(reduce())
    med = statistics.median
    figures = {"synced_ms": med(synced) * 1e3, "compute_ms": med(compute) * 1e3, "all_reduce_ms": med(comm) * 1e3,
               "grad_mb": grad.numel() * 4 / 1e6}
    gathered: list[dict[str, float] | None] = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        for r, f in enumerate(gathered):
            assert f is not None
            out[r] = f
    dist.destroy_process_group()


def _profile_worker(rank: int, world: int, store_path: str, args: argparse.Namespace, result: str) -> None:
    import json

    out: dict[int, dict[str, float]] = {}
    _profile_rank(rank, world, store_path, args, out)
    if rank == 0:
        Path(result).write_text(json.dumps(out))


def profile(args: argparse.Namespace, work: Path) -> None:
    """Per-step compute and communication at 1 and 2 ranks (see the module docstring)."""
    import json

    import torch.multiprocessing as mp

    load_before = os.getloadavg()[0]
    rows = {}
    for world in (1, 2):
        result = work / f"profile{world}.json"
        mp.spawn(_profile_worker, args=(world, str(work / f"store{world}"), args, str(result)), nprocs=world)
        rows[world] = {int(k): v for k, v in json.loads(result.read_text()).items()}
    print(f"# train step profile: GPT {args.n_layer}x{args.d_model}, context {args.context}, micro-batch "
          f"{args.micro} per rank, fp32, gloo, 1 thread per rank, medians of {args.steps} alternating steps; "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'ranks':>5}{'rank':>5}{'step ms':>10}{'compute ms':>12}{'comm share':>12}{'all_reduce ms':>15}"
          f"{'grad MB':>9}")
    for world, per_rank in rows.items():
        for r, f in sorted(per_rank.items()):
            share = (f["synced_ms"] - f["compute_ms"]) / f["synced_ms"]
            print(f"{world:>5}{r:>5}{f['synced_ms']:>10.1f}{f['compute_ms']:>12.1f}{share:>12.1%}"
                  f"{f['all_reduce_ms']:>15.2f}{f['grad_mb']:>9.2f}")
    one = rows[1][0]["compute_ms"]
    two = statistics.mean(f["compute_ms"] for f in rows[2].values())
    print(f"# compute alone at 2 ranks is {two / one:.2f}x its time at 1 rank: the bound on the speed-up from "
          f"sharing the cores is {2 * one / two:.2f}x before any communication")


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
    parser.add_argument("--profile", action="store_true", help="time compute and communication of a step instead")
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="scaling-", dir=args.dir))
    try:
        if args.profile:
            profile(args, work)
            return 0
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

"""Weight broadcast bandwidth: flat buckets vs tensor by tensor vs one dist.broadcast of a single
buffer of the same bytes (what the bench job's broadcast measures), on N local gloo ranks.

nccl-tests conventions: time per iteration averaged over ranks, algbw = bytes/1e9/s, busbw =
algbw (broadcast). Prints the median busbw of each and the ratios to the single-buffer peer.

    python benchmarks/infer_broadcast.py [--ranks 2 --layers 8 --d-model 512 --bucket-mb 64]
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

from hpcdist.infer.broadcast import broadcast_state, describe  # noqa: E402
from hpcdist.model.checkpoint import parameter_shapes as expected_shapes  # noqa: E402
from hpcdist.model.config import GPTConfig  # noqa: E402


def _rank(rank: int, world: int, cfg: GPTConfig, bucket: int, iters: int) -> dict[str, Any]:
    import torch.distributed as dist

    state = {k: torch.randn(s) for k, s in expected_shapes(cfg).items()}
    meta = describe(state)
    src = state if rank == 0 else None
    nbytes = sum(v.numel() * 4 for v in state.values())
    flat = torch.zeros(nbytes // 4)
    out: dict[str, list[float]] = {"buckets": [], "per_tensor": [], "single_buffer": []}
    for i in range(iters + 1):
        for name in out:
            dist.barrier()
            if name == "single_buffer":
                t = time.perf_counter()
                dist.broadcast(flat, src=0)
                s = time.perf_counter() - t
            else:
                _, stats = broadcast_state(src, torch.device("cpu"), bucket if name == "buckets" else 0, meta=meta)
                s = stats.seconds
            if i:
                out[name].append(s)
    return {"bytes": nbytes, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    cfg = GPTConfig(context=512, n_layer=args.layers, n_head=8, d_model=args.d_model)
    outs = run_ranks(args.ranks, _rank, cfg, int(args.bucket_mb * (1 << 20)), args.iters)
    nbytes = outs[0]["bytes"]
    print(f"{args.ranks} ranks, {nbytes / 1e6:.1f} MB ({len(expected_shapes(cfg))} tensors), "
          f"bucket {args.bucket_mb} MB, {args.iters} iterations")
    bw = {}
    for name in ("buckets", "per_tensor", "single_buffer"):
        per_iter = [statistics.mean(o[name][i] for o in outs) for i in range(args.iters)]
        bw[name] = statistics.median(nbytes / 1e9 / t for t in per_iter)
        print(f"{name:>14}: busbw median {bw[name]:.3f} GB/s")
    print(f"buckets / single buffer: {bw['buckets'] / bw['single_buffer']:.2f}; "
          f"per tensor / single buffer: {bw['per_tensor'] / bw['single_buffer']:.2f}")


if __name__ == "__main__":
    main()

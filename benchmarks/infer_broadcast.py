"""Weight broadcast bandwidth: hpcdist's `broadcast_state` against one dist.broadcast of a
single buffer of the same bytes (what the bench job's broadcast measures), and the
tensor-by-tensor baseline, on N local gloo ranks, with every rank's received weights checked.

nccl-tests conventions: time per iteration averaged over ranks, algbw = bytes/1e9/s, busbw =
algbw (broadcast). Prints the median busbw of each, the ratio to its single-buffer peer (the
median of the per-iteration ratios, all methods running back to back in each iteration), and
whether every rank's sha256 of every received tensor equals rank 0's.

- ``one flat storage``: rank 0's tensors are views of the flat buffer already (as the
  ``broadcast`` job makes them), every rank reuses its buffer; peer: one preallocated buffer;
- ``separate tensors``: rank 0's tensors are separate (the big ones go from their own storage,
  the small ones are packed), every rank reuses its receive buffer; peer: the same;
- ``one-shot``: as a load does it once (``infer_gpt``'s ``load: broadcast``): separate tensors
  on rank 0 and every other rank allocates its buffer, whose pages fault in while receiving;
  peer: one broadcast into a buffer the receivers allocate each time, the same way;
- ``per tensor``: `bucket_bytes=0`, one broadcast per tensor, buffers reused.

    python benchmarks/infer_broadcast.py                        # 102.5 MB: 8 layers, d_model 512
    python benchmarks/infer_broadcast.py --model gpt2-small     # 124M parameters, 498 MB
    python benchmarks/infer_broadcast.py --checkpoint gpt2.h5   # a real checkpoint's weights (`model import`)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _ranks import run_ranks  # noqa: E402

from hpcdist.infer.broadcast import broadcast_state, describe, flat_buffer, in_buffer  # noqa: E402
from hpcdist.model.checkpoint import parameter_shapes as expected_shapes  # noqa: E402
from hpcdist.model.config import GPTConfig  # noqa: E402
from hpcdist.model.hf import SIZES  # noqa: E402

NAMES = ("in_place", "packed", "fresh", "per_tensor", "single_buffer", "single_fresh")
LABELS = {"in_place": "hpcdist, one flat storage", "packed": "hpcdist, separate tensors",
          "fresh": "hpcdist, one-shot", "per_tensor": "per tensor", "single_buffer": "single buffer (peer)",
          "single_fresh": "single buffer, one-shot"}
PEER = {"in_place": "single_buffer", "packed": "single_buffer", "fresh": "single_fresh",
        "per_tensor": "single_buffer", "single_buffer": "single_buffer", "single_fresh": "single_buffer"}


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for v in state.values():
        h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()


def _rank(rank: int, world: int, cfg: GPTConfig, bucket: int, iters: int, checkpoint: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    shapes = {k: s for k, s in expected_shapes(cfg).items()}
    state = {k: torch.randn(s, generator=gen) for k, s in shapes.items()} if rank == 0 else None
    if checkpoint is not None and rank == 0:
        from hpcdist.model.checkpoint import read_full, read_header

        state = read_full(read_header(checkpoint))
    meta = describe({k: torch.empty(s) for k, s in shapes.items()})
    nbytes = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    flat = torch.zeros(nbytes // 4)
    buffer = flat_buffer(meta, torch.device("cpu"))
    packed_buffer = flat_buffer(meta, torch.device("cpu"))
    in_place = in_buffer(state, meta, buffer) if state is not None else None  # views of `buffer`
    out: dict[str, list[float]] = {name: [] for name in NAMES}
    digests: dict[str, str] = {}
    for i in range(iters + 1):
        for name in NAMES:
            dist.barrier()
            if name in ("single_buffer", "single_fresh"):
                t = time.perf_counter()
                # a one-shot receiver allocates, as broadcast_state does (pages fault in on receipt)
                target = flat if name == "single_buffer" or rank == 0 else torch.empty(nbytes // 4)
                dist.broadcast(target, src=0)
                s = time.perf_counter() - t
                del target
            else:
                got, stats = broadcast_state(
                    in_place if name == "in_place" and rank == 0 else state, torch.device("cpu"),
                    0 if name == "per_tensor" else bucket, meta=meta,
                    buffer={"in_place": buffer, "packed": packed_buffer, "per_tensor": packed_buffer}.get(name),
                )
                s = stats.seconds
                if i == iters:
                    digests[name] = _digest(got)
                del got
            if i:
                out[name].append(s)
    return {"bytes": nbytes, "digests": digests, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--model", choices=sorted(SIZES), default=None, help="a GPT-2 size's shapes (gpt2-small: 124M)")
    ap.add_argument("--checkpoint", default=None, help="broadcast this checkpoint's weights (e.g. `model import`)")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    if args.checkpoint:
        from hpcdist.model.checkpoint import read_header

        cfg = read_header(args.checkpoint).config
    elif args.model:
        cfg = SIZES[args.model]
    else:
        cfg = GPTConfig(context=512, n_layer=args.layers, n_head=8, d_model=args.d_model)
    outs = run_ranks(args.ranks, _rank, cfg, int(args.bucket_mb * (1 << 20)), args.iters, args.checkpoint)
    nbytes = outs[0]["bytes"]
    print(f"# {args.ranks} ranks (gloo, local), {nbytes / 1e6:.1f} MB ({len(expected_shapes(cfg))} tensors), "
          f"bucket {args.bucket_mb} MB, {args.iters} iterations, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    times = {name: [statistics.mean(o[name][i] for o in outs) for i in range(args.iters)] for name in NAMES}
    for name in NAMES:
        bw = statistics.median(nbytes / 1e9 / t for t in times[name])
        # the ratio of each iteration (all methods ran back to back in it), then the median:
        # robust to the load of a shared machine drifting between iterations
        peer = PEER[name]
        ratio = statistics.median(p / t for p, t in zip(times[peer], times[name], strict=True))
        print(f"{LABELS[name]:<26} busbw median {bw:6.3f} GB/s   vs {LABELS[peer]:<24} {ratio:.2f}")
    same = all(o["digests"][k] == outs[0]["digests"][k] for o in outs for k in outs[0]["digests"])
    print(f"sha256 of the received weights identical on every rank: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

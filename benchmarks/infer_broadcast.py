"""Weight broadcast bandwidth: hpcdist's `broadcast_state` against one dist.broadcast of a
single buffer of the same bytes (what the bench job's broadcast measures), and the
tensor-by-tensor baseline, on N local gloo ranks, with every rank's received weights checked.

nccl-tests conventions: time per iteration averaged over ranks, algbw = bytes/1e9/s, busbw =
algbw (broadcast). Prints the median busbw of each, the ratio to its single-buffer peer (the
median of the per-iteration ratios: in each iteration every method runs right beside a run of its
peer, the two in turn first), each rank's CPU time (all its threads: less moved by other people's
load than the wall clock), and whether every rank's sha256 of every received tensor equals rank 0's.
``--profile`` shows where the time goes instead: a collective's cost, bandwidth by size, rank 0's
copy rate, and the separate-tensor plan's collectives without packing beside `broadcast_state`.

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

from hpcdist.infer.broadcast import (  # noqa: E402
    broadcast_state,
    buffer_order,
    describe,
    direct_bytes,
    flat_buffer,
    in_buffer,
    layout,
    plan_buckets,
)
from hpcdist.model.config import GPTConfig  # noqa: E402
from hpcdist.model.hf import SIZES  # noqa: E402
from hpcdist.model.shapes import parameter_shapes as expected_shapes  # noqa: E402

NAMES = ("in_place", "packed", "fresh", "per_tensor", "single_buffer", "single_fresh")
METHODS = NAMES[:4]  # hpcdist's; each runs beside its peer in every iteration
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


def _rank(rank: int, world: int, cfg: GPTConfig, bucket: int, iters: int, checkpoint: str | None,
          direct: int | None) -> dict[str, Any]:
    import torch.distributed as dist

    if direct is not None:  # a trial of another split (every rank alike: it sets the buckets)
        import hpcdist.infer.broadcast

        hpcdist.infer.broadcast.DIRECT_BYTES = direct

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
    # each method's times, and those of the peer runs beside it ("single_buffer:packed")
    keys = [*METHODS, *(f"{PEER[name]}:{name}" for name in METHODS)]
    out: dict[str, list[float]] = {key: [] for key in keys}
    cpu: dict[str, list[float]] = {key: [] for key in keys}
    digests: dict[str, str] = {}

    def run(name: str, last: bool) -> tuple[float, float]:
        """One transfer by `name`: its seconds on this rank and this rank's CPU seconds (all threads)."""
        dist.barrier()
        c = time.process_time()
        if name in ("single_buffer", "single_fresh"):
            t = time.perf_counter()
            # a one-shot receiver allocates, as broadcast_state does (pages fault in on receipt)
            target = flat if name == "single_buffer" or rank == 0 else torch.empty(nbytes // 4)
            dist.broadcast(target, src=0)
            return time.perf_counter() - t, time.process_time() - c
        got, stats = broadcast_state(
            in_place if name == "in_place" and rank == 0 else state, torch.device("cpu"),
            0 if name == "per_tensor" else bucket, meta=meta,
            buffer={"in_place": buffer, "packed": packed_buffer, "per_tensor": packed_buffer}.get(name),
        )
        c = time.process_time() - c
        if last:
            digests[name] = _digest(got)
        return stats.seconds, c

    for i in range(iters + 1):  # the first is warm-up
        # each method right beside a run of its peer, the two in turn first, and each iteration
        # starting one method later: a shared machine's load comes in bursts that would otherwise
        # fall on one method more than on its peer (the same order on every rank)
        for k, name in enumerate(METHODS[i % len(METHODS):] + METHODS[: i % len(METHODS)]):
            pair = (name, PEER[name]) if (i + k) % 2 else (PEER[name], name)
            for one in pair:
                seconds, used = run(one, last=i == iters)
                if i:
                    out[one if one == name else f"{one}:{name}"].append(seconds)
                    cpu[one if one == name else f"{one}:{name}"].append(used)
    return {"bytes": nbytes, "digests": digests, "cpu": cpu, **out}


def _profile(rank: int, world: int, cfg: GPTConfig, bucket: int, iters: int) -> dict[str, Any]:
    """Each part of the cost of `broadcast_state` from separate tensors, measured alone: one
    collective's fixed cost, a broadcast's bandwidth by size, rank 0's copy rate, and the plan's
    collectives sent from the flat buffer (nothing packed) beside `broadcast_state` itself."""
    import torch.distributed as dist

    cpu_dev = torch.device("cpu")
    shapes = expected_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}  # every rank: for the copy rate
    meta = describe(state)
    offsets, total = layout(meta)
    sizes = [torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, shape, dtype in meta]
    buffer, staging = flat_buffer(meta, cpu_dev), flat_buffer(meta, cpu_dev)
    buffer.fill_(1), staging.fill_(1)
    # the plan `broadcast_state` makes for separate tensors: big ones alone, the small ones packed
    order, direct = buffer_order(meta), direct_bytes(cpu_dev)
    starts = [b[0] for b in plan_buckets([meta[i] for i in order], bucket, [sizes[i] >= direct for i in order])]
    spans = [(offsets[order[a]], offsets[order[b - 1]] + sizes[order[b - 1]])
             for a, b in zip(starts, [*starts[1:], len(order)], strict=True)]
    packed = [i for i in order if sizes[i] < direct]
    tiny = torch.zeros(64, dtype=torch.uint8)
    out: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> None:
        dist.barrier()
        c, t = time.process_time(), time.perf_counter()
        fn()
        out.setdefault(name, []).append(time.perf_counter() - t)
        out.setdefault(name + ":cpu", []).append(time.process_time() - c)

    def calls(n: int) -> None:
        for work in [dist.broadcast(tiny, src=0, async_op=True) for _ in range(n)]:
            work.wait()

    def from_buffer() -> None:
        for work in [dist.broadcast(buffer[a:b], src=0, async_op=True) for a, b in spans]:
            work.wait()

    views = {m[0]: v for m, v in zip(meta, in_buffer(state, meta, staging).values(), strict=True)}
    for _ in range(iters):
        timed("calls", lambda: calls(100))
        for mb in (1, 4, 16, 64):
            timed(f"size {mb} MiB", lambda mb=mb: dist.broadcast(buffer[: mb << 20], src=0))
        timed("copy", lambda: [views[k].copy_(v) for k, v in state.items()])
        timed("copy small", lambda: [views[meta[i][0]].copy_(state[meta[i][0]]) for i in packed])
        timed("single buffer", lambda: dist.broadcast(buffer[:total], src=0))
        timed("plan from buffer", from_buffer)
        timed("broadcast_state", lambda: broadcast_state(state if rank == 0 else None, cpu_dev, bucket, meta=meta,
                                                         buffer=staging))
    return {"times": out, "bytes": total, "tensors": len(meta), "collectives": len(spans),
            "packed": sum(sizes[i] for i in packed)}


def _print_profile(outs: list[dict[str, Any]], ranks: int) -> None:
    med = {k: [statistics.median(o["times"][k]) for o in outs] for k in outs[0]["times"]}
    wall = {k: statistics.mean(v) for k, v in med.items()}  # each rank's median, averaged across ranks
    nbytes = outs[0]["bytes"]
    per_call = wall["calls"] / 100
    cpu_call = "/".join(f"{v / 100 * 1e6:.0f}" for v in med["calls:cpu"])
    copy_gbps = nbytes / 1e9 / med["copy"][0]  # rank 0's: the one that packs
    print(f"# profile: {ranks} ranks (gloo, local), {nbytes / 1e6:.1f} MB in {outs[0]['tensors']} tensors, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print(f"one collective (64 B, 100 started at once): {per_call * 1e6:.0f} us wall, CPU us per rank {cpu_call}")
    print("one broadcast by size: " + ", ".join(
        f"{k.removeprefix('size ')} {(int(k.split()[1]) << 20) / 1e9 / wall[k]:.2f} GB/s"
        for k in wall if k.startswith("size ") and not k.endswith(":cpu"))
        + f", the model {nbytes / 1e9 / wall['single buffer']:.2f} GB/s")
    single, plan, real = wall["single buffer"], wall["plan from buffer"], wall["broadcast_state"]
    # a collective's time against rank 0's time to copy: the size where packing and sending alone tie
    direct_mib = direct_bytes(torch.device("cpu")) / (1 << 20)
    print(f"rank 0 copies at {copy_gbps:.1f} GB/s: a tensor below {per_call * copy_gbps * 1e3:.1f} MB costs less "
          f"to pack than to send alone (hpcdist sends alone from {direct_mib:g} MiB)")
    print(f"separate tensors: {outs[0]['collectives']} broadcasts + 1 for the plan, "
          f"{outs[0]['packed'] / 1e6:.1f} MB packed ({1e3 * med['copy small'][0]:.1f} ms to copy on rank 0)")
    print(f"  single buffer {single * 1e3:.1f} ms; the same broadcasts from the flat buffer {plan * 1e3:.1f} ms "
          f"({(plan - single) * 1e3:+.1f}: collectives); broadcast_state {real * 1e3:.1f} ms "
          f"({(real - plan) * 1e3:+.1f}: plan, packing, Python); single / broadcast_state {single / real:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--model", choices=sorted(SIZES), default=None, help="a GPT-2 size's shapes (gpt2-small: 124M)")
    ap.add_argument("--checkpoint", default=None, help="broadcast this checkpoint's weights (e.g. `model import`)")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--direct-mb", type=float, default=None,
                    help="try sending tensors alone from this size (MiB) instead of hpcdist's; 1e6: pack all")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="where the time goes: per-call cost, bandwidth by size, copy rate, the separate-tensor plan")
    args = ap.parse_args()
    if args.checkpoint:
        from hpcdist.model.checkpoint import read_header

        cfg = read_header(args.checkpoint).config
    elif args.model:
        cfg = SIZES[args.model]
    else:
        cfg = GPTConfig(context=512, n_layer=args.layers, n_head=8, d_model=args.d_model)
    if args.profile:
        _print_profile(run_ranks(args.ranks, _profile, cfg, int(args.bucket_mb * (1 << 20)), args.iters), args.ranks)
        return
    direct = None if args.direct_mb is None else int(args.direct_mb * (1 << 20))
    outs = run_ranks(args.ranks, _rank, cfg, int(args.bucket_mb * (1 << 20)), args.iters, args.checkpoint, direct)
    nbytes = outs[0]["bytes"]
    print(f"# {args.ranks} ranks (gloo, local), {nbytes / 1e6:.1f} MB ({len(expected_shapes(cfg))} tensors), "
          f"bucket {args.bucket_mb} MB, alone from {(direct or direct_bytes(torch.device('cpu'))) / (1 << 20):g} MiB, "
          f"{args.iters} iterations, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    # each run's time averaged across ranks (nccl-tests), by method and by the peer runs beside it
    times = {key: [statistics.mean(o[key][i] for o in outs) for i in range(args.iters)] for key in outs[0]["cpu"]}
    for name in NAMES:
        own = [key for key in times if key == name or key.startswith(f"{name}:")]  # a peer: all its runs
        bw = statistics.median(nbytes / 1e9 / t for key in own for t in times[key])
        # CPU time (all threads) moves less with other people's load than the wall clock does
        cpu_ms = "/".join(f"{1e3 * statistics.median(c for key in own for c in o['cpu'][key]):.0f}" for o in outs)
        peer = PEER[name]
        if name in METHODS:  # the median of each iteration's ratio to the peer run beside it
            ratio = statistics.median(p / t for p, t in zip(times[f"{peer}:{name}"], times[name], strict=True))
        else:
            ratio = bw * statistics.median(t for key in times if key.startswith(f"{peer}:") for t in times[key]) / (
                nbytes / 1e9)
        print(f"{LABELS[name]:<26} busbw median {bw:6.3f} GB/s   vs {LABELS[peer]:<24} {ratio:.2f}   "
              f"CPU ms per rank {cpu_ms}")
    same = all(o["digests"][k] == outs[0]["digests"][k] for o in outs for k in outs[0]["digests"])
    print(f"sha256 of the received weights identical on every rank: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""Sharded checkpoints against PyTorch DCP in the same run: 2 ranks (forked, gloo), the same state.

States: "replicated" (a model and two AdamW moments as plain tensors, the same on every rank:
DCP's planner writes each once) and "fsdp" (an MLP under FSDP2 ``fully_shard`` with its AdamW
state, keyed by name through ``get_state_dict``). For each, alternating in every repeat:

- save: ``dcp.save`` with ``FileSystemWriter`` (fsync on) vs ``hpcdist.store.sharded.checkpoint.save``
  (fsync, sha256 per chunk, one commit);
- load: ``dcp.load`` (no checksum) vs ``hpcdist.store.sharded.checkpoint.load`` (every chunk verified);
- blocked: time until ``dcp.async_save`` returns vs until ``sharded.save_async`` returns (the
  rest of the write goes on in a thread; both are waited for before the next step).

Deleting old checkpoints is outside every timing on both sides: rank 0 removes DCP's folders
between rounds, and hpcdist's retention (``keep_last=1``) deletes pruned shard folders in a
background thread, waited for (``sharded.purge_wait``) before the next measurement.

With ``--api`` hpcdist's side is the public API a user calls, ``ctx.checkpoints``: ``save(step,
state, replicated=True)`` (the FSDP2 state's DTensors take that path by themselves), ``load_latest
(into=state)``, ``save(..., background=True)`` (each waited for with ``wait()``); DCP's is the same.

Each figure is the median over --repeat of the slowest rank's time, printed as DCP's time divided
by hpcdist's (above 1: hpcdist is faster), with the load average and each rank's peak memory, and
the checksums' rates on one core: a verified load hashes its MB per rank at that rate, a floor no
reader goes below. ``--json`` prints one JSON line instead: a list with one object per state (keys
``state``, ``mb``, ``save``, ``load``, ``block``: DCP's time / hpcdist's; ``hpcdist_s``, ``dcp_s``:
each side's seconds; ``path``, ``checksum``, ``hashed_mb_per_rank``, ``hash_gb_per_s``: each checksum on one core,
``hash_floor_s``: the chosen one's time for the MB hashed per rank, ``load_average``).

    PYTHONPATH=. .venv/bin/python benchmarks/ckpt_sharded.py --dir /var/tmp/hpcdist-bench --mb 200 --repeat 3
    PYTHONPATH=. .venv/bin/python benchmarks/ckpt_sharded.py --mb 768 --api --json
"""

# ruff: noqa: B023  (each round's lambdas run within that round)
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks._ranks import run_ranks


def replicated_state(mb: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    rows = max(1, mb * (1 << 20) // 3 // 16 // 4096)  # 16 tensors of rows x 1024 fp32 per part
    return {part: {f"layer{i}.weight": torch.randn(rows, 1024) for i in range(16)}
            for part in ("model", "exp_avg", "exp_avg_sq")}


def fsdp_state(mb: int, world: int) -> tuple[dict[str, Any], Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = 1024
    layers = max(1, mb * (1 << 20) // 3 // 4 // (width * width))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sampler": {"position": 1234}}, model


def timed(fn: Any) -> float:
    """The slowest rank's time for `fn` (every rank starts together), timed on the default group:
    a background save's collectives run on their own group meanwhile, as in ``ctx.checkpoints``."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def api_context(rank: int, world: int, root: Path) -> Any:
    """This rank's ``hpcdist.Context`` as the bootstrap builds it (the ``local`` site, storage under
    `root`, the benchmark's own gloo group), checkpoints in ``root/ours``, keeping 1."""
    import logging

    import torch

    from hpcdist.api import Context
    from hpcdist.config import load_site
    from hpcdist.config.spec import JobSpec
    from hpcdist.runtime.job_rank import JobRank
    from hpcdist.runtime.rankinfo import RankInfo

    site = load_site("local", [f"storage.{k}={root / k}" for k in ("results", "checkpoints", "logs", "scratch")])
    spec = JobSpec.model_validate({"name": "bench", "kind": "python", "timeout_s": 600})
    info = RankInfo("local", rank, world, rank, world, 0, 1, job_id="bench")
    job = JobRank(spec=spec, site=site, info=info, backend="gloo", device=torch.device("cpu"), timeout_s=600,
                     hosts=(info.hostname,) * world, log=logging.getLogger("hpcdist"))
    return Context(job, checkpoint_dir=root / "ours", keep_last=1, io_timeout_s=600)


def bench(rank: int, world: int, kind: str, mb: int, repeat: int, root: str, api: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hpcdist.store.sharded import checkpoint as sharded

    warnings.simplefilter("ignore")
    state = replicated_state(mb) if kind == "replicated" else fsdp_state(mb, world)[0]
    base = Path(root) / kind
    ctx = api_context(rank, world, base) if api else None
    # the checkpoint I/O group: ctx.checkpoints's own, or one like it
    group = ctx.checkpoints._io_group if ctx is not None else dist.new_group(backend="gloo")
    times: dict[str, list[float]] = {k: [] for k in ("save_dcp", "save_ours", "load_dcp", "load_ours",
                                                     "blocked_dcp", "blocked_ours")}
    stager = sharded.Stager(group)  # as ctx.checkpoints keeps one
    for r in range(repeat):
        dcp_dir, ours = base / f"dcp{r}", base / "ours"
        index = ours / f"step_{r:08d}.h5"
        save_ours = ((lambda: ctx.checkpoints.save(r, state, replicated=True)) if ctx is not None
                     else (lambda: sharded.save(ours, r, state, process_group=group, keep_last=1)))
        pairs = [("dcp", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dcp_dir)),
                                          process_group=group)),
                 ("ours", save_ours)]
        for name, fn in pairs if r % 2 == 0 else pairs[::-1]:
            times[f"save_{name}"].append(timed(fn))
        sharded.purge_wait()  # the pruned step's deletion, untimed as rank 0's rmtree of DCP's folders
        loads = [("dcp", lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(str(dcp_dir)),
                                          process_group=group)),
                 ("ours", (lambda: ctx.checkpoints.load_latest(into=state)) if ctx is not None
                  else (lambda: sharded.load(index, state, process_group=group)))]
        for name, fn in loads if r % 2 == 0 else loads[::-1]:
            times[f"load_{name}"].append(timed(fn))
        futures: dict[str, Any] = {}
        starts = [("dcp", lambda: futures.update(dcp=dcp.async_save(
                      state, storage_writer=dcp.FileSystemWriter(str(dcp_dir) + "a"), process_group=group))),
                  ("ours", (lambda: ctx.checkpoints.save(1000 + r, state, replicated=True, background=True))
                   if ctx is not None else (lambda: futures.update(ours=sharded.save_async(
                      state, sharded.ShardedWriter(ours, 1000 + r, keep_last=1), group, stager))))]
        for name, fn in starts if r % 2 == 0 else starts[::-1]:
            times[f"blocked_{name}"].append(timed(fn))
            if name == "dcp":
                futures[name].result()
            elif ctx is not None:
                ctx.checkpoints.wait()
            else:
                sharded.wait(futures[name])
            sharded.purge_wait()
        dist.barrier(group)
        if rank == 0:
            for d in (dcp_dir, Path(str(dcp_dir) + "a")):
                shutil.rmtree(d, ignore_errors=True)
    last = base / "ours" / f"step_{1000 + repeat - 1:08d}.h5"  # the background save's, the newest
    reader = sharded.ShardedReader(last, group)  # as sharded.load's, untimed: what it hashes
    dcp.load(state, storage_reader=reader, process_group=group)
    dist.barrier(group)
    if ctx is not None:
        ctx.close()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    return {"times": times, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "hashed_mb": reader.bytes_hashed / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp/hpcdist-bench")
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kinds", default="replicated,fsdp")
    parser.add_argument("--api", action="store_true", help="hpcdist's side through ctx.checkpoints (the public API)")
    parser.add_argument("--json", action="store_true", help="print one JSON line (a list, one object per state)")
    args = parser.parse_args()
    import h5py
    import torch
    from rich.console import Console
    from rich.table import Table

    root = Path(args.dir) / f"ckpt_sharded-{os.getpid()}"
    table = Table(title=f"DCP time / hpcdist time, 2 ranks, {args.mb} MB, medians of {args.repeat} "
                        "(above 1: hpcdist faster)")
    for col in ("state", "save", "verified load", "blocked (async)", "hpcdist save / load / blocked s",
                "DCP save / load / blocked s", "verified MB per rank", "peak RSS MB"):
        table.add_column(col)
    from hpcdist.store import checksum

    rows = []
    rates = hash_rates()  # measured here, before the ranks start: the floor each verified load pays
    for kind in args.kinds.split(","):
        out = run_ranks(2, bench, kind, args.mb, args.repeat, str(root), args.api)
        t = out[0]["times"]
        med = {k: statistics.median(v) for k, v in t.items()}
        ratio = {op: med[f"{op}_dcp"] / med[f"{op}_ours"] for op in ("save", "load", "blocked")}
        rows.append({"state": kind, "mb": args.mb, "save": round(ratio["save"], 3), "load": round(ratio["load"], 3),
                     "block": round(ratio["blocked"], 3),
                     "hpcdist_s": {op: round(med[f"{k}_ours"], 4) for op, k in
                                   (("save", "save"), ("load", "load"), ("block", "blocked"))},
                     "dcp_s": {op: round(med[f"{k}_dcp"], 4) for op, k in
                               (("save", "save"), ("load", "load"), ("block", "blocked"))},
                     "path": "ctx.checkpoints" if args.api else "sharded", "checksum": checksum.chosen(),
                     "hashed_mb_per_rank": [round(o["hashed_mb"], 1) for o in out],
                     "hash_gb_per_s": {k: round(v, 2) for k, v in rates.items()},
                     "hash_floor_s": round(max(o["hashed_mb"] for o in out) / 1e3 / rates[checksum.chosen()], 4),
                     "load_average": round(os.getloadavg()[0], 2)})
        table.add_row(kind, f"{ratio['save']:.2f}", f"{ratio['load']:.2f}", f"{ratio['blocked']:.2f}",
                      f"{med['save_ours']:.2f} / {med['load_ours']:.2f} / {med['blocked_ours']:.3f}",
                      f"{med['save_dcp']:.2f} / {med['load_dcp']:.2f} / {med['blocked_dcp']:.3f}",
                      " / ".join(f"{o['hashed_mb']:.0f}" for o in out),
                      " / ".join(f"{o['maxrss_mb']:.0f}" for o in out))
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
        return
    Console(width=200).print(table)
    hashed = max(max(r["hashed_mb_per_rank"]) for r in rows)
    print(f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}, h5py {h5py.__version__}, "
          f"{os.cpu_count()} CPUs; path {rows[0]['path']}, checksum {checksum.chosen()}; GB/s on one core: "
          + ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
          + f" (a verified load's floor, {hashed:.0f} MB hashed per rank: "
          + ", ".join(f"{k} {hashed / 1e3 / v:.3f} s" for k, v in rates.items()) + ")")


def hash_rates() -> dict[str, float]:
    """Each checksum candidate on one core of this CPU, GB/s, best of 3 over 64 MiB (those installed)."""
    import hashlib
    import importlib.util

    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    frozen = data.view()
    frozen.setflags(write=False)  # google-crc32c takes only a read-only buffer
    candidates: dict[str, Any] = {"xxh3-128": lambda: __import__("xxhash").xxh3_128_hexdigest(data.data)}
    if importlib.util.find_spec("google_crc32c"):
        candidates["crc32c"] = lambda: __import__("google_crc32c").value(frozen)
    if importlib.util.find_spec("blake3"):
        candidates["blake3"] = lambda: __import__("blake3").blake3(data.data).hexdigest()
    candidates["sha256"] = lambda: hashlib.sha256(data.data).hexdigest()
    rates = {}
    for name, fn in candidates.items():
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = max(best, data.nbytes / 1e9 / (time.perf_counter() - t0))
        rates[name] = best
    return rates


if __name__ == "__main__":
    main()

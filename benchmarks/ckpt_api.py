"""The README's checkpoint calls against PyTorch DCP's, in the same run: a DDP model and its AdamW state.

2 ranks (forked, gloo), the state replicated as DDP keeps it. hpcdist's side is what the README
writes, with no option:

    ctx.checkpoints.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
    step, state = ctx.checkpoints.load_latest()          # every chunk verified
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])

DCP's is its own documented pattern (``FileSystemWriter``, fsync on; its load verifies nothing):

    dcp.save({"model": model.state_dict(), "opt": opt.state_dict()}, checkpoint_id=folder)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dcp.load(state, checkpoint_id=folder); model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])

After each load, both sides time the optimizer's next ``opt.step()`` (gradients kept from the
first step): the first write into the state just loaded, where hpcdist's copy-on-write views of the
checkpoint's pages (``hpcdist.store.sharded.node_read``) get pages of their own, which DCP's in-place load
into the optimizer's existing tensors never needs; ``load_and_step`` is the ratio of the two sums.

Each ratio is DCP's time / hpcdist's (above 1: hpcdist faster), the slowest rank's time on each
side, the median over --repeat rounds of each round's ratio (both sides in the same run,
alternating which goes first); the seconds are the medians of each side's times.
Deleting old checkpoints is outside the timings on both sides (rank 0 removes DCP's folders
between rounds; hpcdist's pruned shards are deleted in the background and waited for untimed).
Each round ends with ``dd conv=fsync`` of the same bytes by rank 0 (``dd_s``): what the disk gives
one writer then, since both sides write the same bytes to it; and with every rank's share of them
written by ``dd conv=fsync`` at once (``dd_ranks_s``, the slowest rank's): the disk's own ceiling for
the split both sides make, against which each side's save is a fraction (``save_vs_dd_ranks``: 1 is
the disk's speed, and no save of these bytes is faster than DCP's by more than DCP's own distance
from it).

With ``--ranks 1``: one process, the same calls, against ``dd conv=fsync`` of the same bytes
(save) and ``torch.load(weights_only=True)`` of ``torch.save`` of the same state (verified load),
in the same run; and a resume on each side: the load, ``load_state_dict`` of the model and the
optimizer, and the next ``opt.step()`` (where copy-on-write views first get pages of their own).

With ``--tmpfs``: the same run in a folder on tmpfs (``/dev/shm``; refused when that is not tmpfs
or has too little room), where the "disk" is memory and fsync a no-op: what is left is the save's
own cost (copies, checksums, the cross-rank check, the commit), against DCP and ``dd`` writing the
same bytes to the same tmpfs. On a disk the figures move 2-5x from run to run with the disk.

The goals, printed with each run (medians of 7): on tmpfs, the save at least 1.2x DCP's speed
(DCP's time / hpcdist's) and at least 0.8x ``dd``'s (the same split: each rank's share by ``dd`` at
once; at one rank, ``dd`` of all the bytes); on a disk, at least DCP's speed.

    PYTHONPATH=. .venv/bin/python benchmarks/ckpt_api.py --dir /var/tmp/hpcdist-bench --mb 192 --repeat 7
    PYTHONPATH=. .venv/bin/python benchmarks/ckpt_api.py --dir /var/tmp/hpcdist-bench --mb 768 --repeat 7
    PYTHONPATH=. .venv/bin/python benchmarks/ckpt_api.py --dir /var/tmp/hpcdist-bench --mb 256 --ranks 1 --repeat 7
    PYTHONPATH=. .venv/bin/python benchmarks/ckpt_api.py --tmpfs --mb 192 --repeat 7
"""

# ruff: noqa: B023  (each round's lambdas run within that round)
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks._ranks import run_ranks
from benchmarks.ckpt_sharded import api_context, timed

TMPFS = Path("/dev/shm/hpcdist-bench")
# The goals (issue 56, item 6): the save's speed over its peer's (peer's time / hpcdist's), medians.
GOALS = {"tmpfs": {"DCP": 1.2, "dd": 0.8}, "disk": {"DCP": 1.0}}


def fs_type(path: Path) -> str:
    """The file system type of the mount that holds `path` (/proc/mounts' longest prefix)."""
    best, kind = "", "unknown"
    real = str(path.resolve())
    with open("/proc/mounts") as fh:
        for line in fh:
            _, point, fstype = line.split()[:3]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fstype
    return kind


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds`."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def ddp_state(mb: int, world: int) -> tuple[Any, Any]:
    """A model of Linear(1024, 1024) layers (DDP at 2 ranks) and its AdamW after one step:
    weights and two moments, `mb` MB in all."""
    import torch

    torch.manual_seed(0)
    layers = max(1, mb * 10**6 // 3 // (4 * 1024 * 1025))
    model: Any = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return model, opt


def state_of(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def nbytes(model: Any, opt: Any) -> int:
    import torch

    tensors = list(model.state_dict().values()) + [
        v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.nbytes for t in tensors)


def two_ranks(rank: int, world: int, mb: int, repeat: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benchmarks.train_checkpoint_io import time_dd
    from hpcdist.store.sharded import checkpoint as sharded

    warnings.simplefilter("ignore")
    model, opt = ddp_state(mb, world)
    base = Path(root)
    ctx = api_context(rank, world, base)
    group = ctx.checkpoints._io_group
    times: dict[str, list[float]] = {k: [] for k in ("save_dcp", "save_ours", "load_dcp", "load_ours",
                                                     "step_dcp", "step_ours", "dd", "dd_ranks")}

    def load_ours() -> None:
        found = ctx.checkpoints.load_latest()
        assert found is not None
        model.load_state_dict(found[1]["model"])
        opt.load_state_dict(found[1]["opt"])

    def load_dcp(folder: Path) -> None:
        state = state_of(model, opt)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), process_group=group)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    for r in range(repeat):
        folder = base / f"dcp{r}"
        saves = [("dcp", lambda: dcp.save(state_of(model, opt), storage_writer=dcp.FileSystemWriter(str(folder)),
                                          process_group=group)),
                 ("ours", lambda: ctx.checkpoints.save(r, state_of(model, opt)))]
        for name, fn in saves if r % 2 == 0 else saves[::-1]:
            times[f"save_{name}"].append(timed(fn))
            sharded.purge_wait()
            gc.collect()
        loads = [("dcp", lambda: load_dcp(folder)), ("ours", load_ours)]
        for name, fn in loads if r % 2 == 0 else loads[::-1]:
            times[f"load_{name}"].append(timed(fn))
            times[f"step_{name}"].append(timed(opt.step))  # the first write into what was loaded
            gc.collect()
        dist.barrier(group)
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            times["dd"].append(time_dd(base / "dd.bin", max(1, round(nbytes(model, opt) / 2**20)))[0])
            (base / "dd.bin").unlink()
        share = base / f"dd{rank}.bin"  # the disk's own ceiling for the split both sides make: each rank its share
        dist.barrier(group)  # all at once; dd's own time (not its process start), the slowest rank's
        times["dd_ranks"].append(slowest(time_dd(share, max(1, round(nbytes(model, opt) / world / 2**20)))[0]))
        share.unlink()
        dist.barrier(group)
    stats = ctx.checkpoints.loaded[-1] if getattr(ctx.checkpoints, "loaded", None) else None
    ctx.close()
    return {"times": times, "bytes": nbytes(model, opt),
            "read_mb": None if stats is None else stats.bytes_read / 1e6}


def one_rank(rank: int, world: int, mb: int, repeat: int, root: str) -> dict[str, Any]:
    import torch

    from benchmarks.train_checkpoint_io import time_dd
    from hpcdist.files.atomic import fsync_path

    warnings.simplefilter("ignore")
    model, opt = ddp_state(mb, 1)
    size = nbytes(model, opt)
    base = Path(root)
    ctx = api_context(rank, world, base)
    times: dict[str, list[float]] = {k: [] for k in ("save_ours", "save_dd", "save_torch", "load_ours", "load_torch",
                                                     "resume_ours", "resume_torch")}

    def save_torch(path: Path) -> None:
        torch.save(state_of(model, opt), path)
        fsync_path(path)

    def load_ours() -> None:
        found = ctx.checkpoints.load_latest()
        assert found is not None

    def resume(state: dict[str, Any]) -> None:  # into the model and optimizer, then the next step
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        opt.step()

    for r in range(repeat):
        path = base / f"torch{r}.pt"
        blocks: list[list[tuple[str, Any]]] = [
            [("save_ours", lambda: ctx.checkpoints.save(r, state_of(model, opt))), ("load_ours", load_ours),
             ("resume_ours", lambda: resume((ctx.checkpoints.load_latest() or (0, {}))[1]))],
            [("save_torch", lambda: save_torch(path)), ("load_torch", lambda: torch.load(path, weights_only=True)),
             ("resume_torch", lambda: resume(torch.load(path, weights_only=True)))]]
        for block in blocks if r % 2 == 0 else blocks[::-1]:
            for name, fn in block:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                gc.collect()
        path.unlink()
        times["save_dd"].append(time_dd(base / "dd.bin", max(1, round(size / 2**20)))[0])
        (base / "dd.bin").unlink()
    ctx.close()
    return {"times": times, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp/hpcdist-bench")
    parser.add_argument("--mb", type=int, default=192, help="MB of model and AdamW state, about")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tmpfs", action="store_true", help=f"write to {TMPFS} (tmpfs: the save's own cost shows)")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = parser.parse_args()
    import torch

    from hpcdist.store import checksum

    where = TMPFS if args.tmpfs else Path(args.dir)
    where.mkdir(parents=True, exist_ok=True)
    fs = fs_type(where)
    if args.tmpfs and fs != "tmpfs":
        raise SystemExit(f"--tmpfs: {where} is on {fs}, not tmpfs; mount one there (mount -t tmpfs -o size=4g "
                         f"tmpfs {where}) or run without --tmpfs")
    need = 4 * args.mb * 10**6  # DCP's folder, hpcdist's checkpoint and the one it replaces, dd's file
    if fs == "tmpfs" and shutil.disk_usage(where).free < need:
        raise SystemExit(f"--mb {args.mb}: {where} has {shutil.disk_usage(where).free / 1e6:.0f} MB free, "
                         f"the run needs about {need / 1e6:.0f} MB (4x the state); give a smaller --mb")
    medium = "tmpfs" if fs == "tmpfs" else "disk"
    root = where / f"ckpt_api-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    try:
        out = run_ranks(args.ranks, two_ranks if args.ranks == 2 else one_rank, args.mb, args.repeat, str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t = out[0]["times"]
    med = {k: statistics.median(v) for k, v in t.items()}
    size = out[0]["bytes"]

    def ratio(peer: str, ours: str) -> float:  # per repeat (measured back to back), then the median
        return statistics.median(a / b for a, b in zip(t[peer], t[ours], strict=True))

    if args.ranks == 2:
        for side in ("dcp", "ours"):
            t[f"resume_{side}"] = [a + b for a, b in zip(t[f"load_{side}"], t[f"step_{side}"], strict=True)]
            med[f"resume_{side}"] = statistics.median(t[f"resume_{side}"])
        row = {"ranks": 2, "mb": round(size / 1e6, 1), "save": round(ratio("save_dcp", "save_ours"), 3),
               "load": round(ratio("load_dcp", "load_ours"), 3),
               "load_and_step": round(ratio("resume_dcp", "resume_ours"), 3),
               "dd_s": round(med["dd"], 4), "dd_ranks_s": round(med["dd_ranks"], 4),
               "save_vs_dd_ranks": round(ratio("dd_ranks", "save_ours"), 3),
               "dcp_save_vs_dd_ranks": round(ratio("dd_ranks", "save_dcp"), 3),
               "hpcdist_s": {k: round(med[f"{k}_ours"], 4) for k in ("save", "load", "step")},
               "dcp_s": {k: round(med[f"{k}_dcp"], 4) for k in ("save", "load", "step")},
               "read_mb_per_rank": [o["read_mb"] for o in out]}
    else:
        row = {"ranks": 1, "mb": round(size / 1e6, 1), "save_vs_dd": round(ratio("save_dd", "save_ours"), 3),
               "load_vs_torch": round(ratio("load_torch", "load_ours"), 3),
               "save_vs_torch": round(ratio("save_torch", "save_ours"), 3),
               "resume_vs_torch": round(ratio("resume_torch", "resume_ours"), 3),
               "hpcdist_s": {"save": round(med["save_ours"], 4), "load": round(med["load_ours"], 4),
                             "resume": round(med["resume_ours"], 4)},
               "peer_s": {"dd": round(med["save_dd"], 4), "torch.save": round(med["save_torch"], 4),
                          "torch.load": round(med["load_torch"], 4), "resume": round(med["resume_torch"], 4)}}
    against = ({"DCP": row["save"], "dd": row["save_vs_dd_ranks"]} if args.ranks == 2
               else {"dd": row["save_vs_dd"]})
    goals = {f"save_vs_{peer}": {"goal": goal, "seen": against[peer], "met": against[peer] >= goal}
             for peer, goal in GOALS[medium].items() if peer in against}
    row.update({"fs": fs, "dir": str(where), "goals": goals, "repeat": args.repeat, "checksum": checksum.chosen(),
                "torch": torch.__version__, "load_average": round(os.getloadavg()[0], 2)})
    if args.json:
        print(json.dumps(row))
        return
    print(f"# {row['mb']} MB of DDP model + AdamW state, {args.ranks} rank(s), medians of {args.repeat}, "
          f"torch {torch.__version__}, checksum {checksum.chosen()}, {where} on {fs}, "
          f"load average {row['load_average']}")
    for name, g in goals.items():
        print(f"goal on {medium}: {name} >= {g['goal']}: {g['seen']:.2f}, {'met' if g['met'] else 'MISSED'}")
    if args.ranks == 2:
        print(f"save:          DCP / hpcdist = {row['save']:.2f}  ({med['save_dcp']:.3f} s / {med['save_ours']:.3f} s; "
              f"dd conv=fsync of the same bytes, one writer: {med['dd']:.3f} s)")
        print(f"save against the {medium}'s own ceiling, each rank's share by dd conv=fsync at once "
              f"({med['dd_ranks']:.3f} s): hpcdist {row['save_vs_dd_ranks']:.2f}, "
              f"DCP {row['dcp_save_vs_dd_ranks']:.2f}")
        print(f"verified load: DCP / hpcdist = {row['load']:.2f}  ({med['load_dcp']:.3f} s / {med['load_ours']:.3f} s)")
        print(f"load + the first opt.step(): DCP / hpcdist = {row['load_and_step']:.2f}  (step alone "
              f"{med['step_dcp']:.3f} s / {med['step_ours']:.3f} s: its first write into what was loaded)")
        print(f"MB each rank read and verified: {row['read_mb_per_rank']}")
    else:
        print(f"save:          dd / hpcdist = {row['save_vs_dd']:.2f}  ({med['save_dd']:.3f} s / "
              f"{med['save_ours']:.3f} s); torch.save+fsync / hpcdist = {row['save_vs_torch']:.2f}")
        print(f"verified load: torch.load / hpcdist = {row['load_vs_torch']:.2f}  ({med['load_torch']:.3f} s / "
              f"{med['load_ours']:.3f} s)")
        print(f"load + load_state_dict + opt.step(): torch / hpcdist = {row['resume_vs_torch']:.2f}  "
              f"({med['resume_torch']:.3f} s / {med['resume_ours']:.3f} s)")


if __name__ == "__main__":
    main()

"""Is hpcdist's benchmark harness what it measures? Side by side, in one run, on the same ranks:

1. MPI point-to-point bandwidth, 4 MiB to 64 MiB: hpcdist's ping-pong (``p2p.exchange``, as the
   ``bench_p2p`` job runs it) against ``mpi4py.bench pingpong`` (shipped with mpi4py), called in
   the same processes with the same warm-up and iteration counts;
2. all_reduce busbw on the gloo path: hpcdist's ``measure`` (as ``bench_collectives`` runs it)
   against a bare ``torch.distributed.all_reduce`` loop of the same sizes and iterations;
3. all_reduce busbw on the MPI path: ``measure`` against a bare ``comm.Allreduce`` loop;
4. the per-iteration timing overhead of hpcdist's timed loop, in microseconds.

Each comparison is repeated ``--trials`` times, alternating which side goes first; the medians
and their ratios (hpcdist / peer) are printed by rank 0, from the mean iteration (nccl-tests'
figure) and from the median one, with the share of iterations over 3x their trial's median. On a
machine with more runnable processes than cores, Open MPI's busy-polling ranks take 10-70 ms for
an iteration whose peer was descheduled (0.3-0.6 ms otherwise at 1 MiB): a few of those set the
mean of 20, and the median shows what the harness itself costs. Run with two ranks:

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
      mpirun -n 2 python benchmarks/bench_harness_overhead.py
    # or inside a Slurm allocation: srun -N 2 --ntasks-per-node=1 --mpi=pmix python benchmarks/...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (both sides)")
    p.add_argument("--p2p-sizes", default="4M,8M,16M,32M,64M")
    p.add_argument("--allreduce-sizes", default="1M,4M,16M,64M")
    p.add_argument("--only", default="p2p,gloo,mpi", help="comparisons to run: p2p, gloo, mpi (comma list)")
    p.add_argument("--json", default=None, help="also write the figures to this file (rank 0)")
    return p.parse_args()


def bootstrap() -> Any:
    """A JobRank through hpcdist's own bootstrap (MPI rendezvous, gloo process group)."""
    from hpcdist.config import load_site
    from hpcdist.config.spec import JobSpec
    from hpcdist.runtime.bootstrap import bootstrap as boot

    site = load_site("local", ["storage.scratch=/tmp/hpcdist-bench-scratch"])
    spec = JobSpec.model_validate({
        "name": "bench-harness", "kind": "bench_collectives", "backend": "gloo", "timeout_s": 300,
        "resources": {"nodes": 1, "tasks_per_node": 2},
        "params": {"paths": ["torch", "mpi"], "ops": ["all_reduce"]},
    })
    ctx = boot(spec, site, uses_mpi=True)
    return ctx, ctx.store


SLOW = 3.0  # an iteration this many times its trial's median: the rank waited for the CPU


@dataclass(frozen=True)
class Trial:
    """One trial of one comparison at one size: each side's figure from its mean iteration time
    (nccl-tests' figure) and from its median iteration, and its share of slow iterations."""

    ours: float
    peer: float
    ours_p50: float
    peer_p50: float
    slow_ours: float
    slow_peer: float

    @classmethod
    def of(cls, ours: np.ndarray, peer: np.ndarray, figure: Callable[[float], float]) -> Trial:
        def slow(t: np.ndarray) -> float:
            return float(np.mean(t > SLOW * np.median(t)))

        return cls(figure(float(ours.mean())), figure(float(peer.mean())), figure(float(np.median(ours))),
                   figure(float(np.median(peer))), slow(ours), slow(peer))


def summary(trials: list[Trial]) -> dict[str, Any]:
    """Median of each side over the trials, their ratio, and the paired ratios (both sides of a
    trial ran back to back, so a pair shares the machine's load; the paired ratio cancels slow
    drifts), from the mean iteration and from the median one."""
    ours, peer = [t.ours for t in trials], [t.peer for t in trials]
    each = [t.ours / t.peer for t in trials]
    return {"hpcdist": statistics.median(ours), "peer": statistics.median(peer),
            "ratio": statistics.median(ours) / statistics.median(peer), "paired_ratio": statistics.median(each),
            "trial_ratios": each, "p50_ratio": statistics.median(t.ours_p50 / t.peer_p50 for t in trials),
            "slow_ours": statistics.mean(t.slow_ours for t in trials),
            "slow_peer": statistics.mean(t.slow_peer for t in trials)}


def main() -> int:
    args = parse()
    from hpcdist.bench.bandwidth import busbw, counts, human_bytes, parse_size

    ctx, store = bootstrap()
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from mpi4py import bench as mpibench

    from hpcdist.bench import pattern
    from hpcdist.bench.base import IN_PLACE, OUT_OF_PLACE, host_timed
    from hpcdist.bench.measure import measure
    from hpcdist.bench.mpi_path import MPIPath
    from hpcdist.bench.p2p import exchange
    from hpcdist.bench.torch_path import TorchPath

    comm = ctx.mpi_comm
    rank, n = comm.Get_rank(), comm.Get_size()
    tp, mp = TorchPath(ctx.device, ctx.backend), MPIPath(comm)
    p2p_sizes = [parse_size(s) for s in args.p2p_sizes.split(",")]
    ar_sizes = [parse_size(s) for s in args.allreduce_sizes.split(",")]
    W, ITERS = args.warmup, args.iters

    def over_ranks(times: np.ndarray) -> np.ndarray:
        """Each iteration's time averaged over the ranks (every rank ran the same iterations)."""
        return np.mean(np.array(comm.allgather(np.asarray(times, dtype=float))), axis=0)

    # ---- each side measures one size and returns its per-iteration seconds, averaged over ranks
    def ours_p2p(size: int) -> np.ndarray:
        return over_ranks(exchange(mp, "pingpong", rank, 1 - rank, rank == 0, size, W, ITERS, 1, False).times)

    def peer_p2p(size: int) -> np.ndarray:
        res = mpibench.pingpong(comm, ["-m", str(size), "-n", str(size), "--skip-huge", str(W),
                                       "--loop-huge", str(ITERS)], verbose=False)
        ((_, t, _),) = res
        return over_ranks(np.full(ITERS, t))  # mpi4py.bench gives only the mean one-way time

    def ours_allreduce(path: Any, mode: str) -> Callable[[int], np.ndarray]:
        def run(size: int) -> np.ndarray:
            c = counts("all_reduce", size, n, 4)
            return over_ranks(measure(path, "all_reduce", c, mode, "float32", W, ITERS, False).times)
        return run

    # The bare loops get their buffers as measure() does, like nccl-tests: allocated with zeros,
    # then the input written before the first call. Both halves matter here: an untouched
    # buffer from zeros reads the kernel's zero page (faster than real data), and the same data
    # in a buffer made another way (numpy's astype over freed temporaries) ran the same
    # Allreduce 2-3x slower at 1-16 MiB on this machine; that is placement, not the harness.
    # They read the clock once per iteration (0.1 us), as hpcdist's loop does, so both sides
    # give the per-iteration times whose median shows what the mean hides on a busy machine.
    def stamped(call: Callable[[], Any]) -> np.ndarray:
        stamps = np.empty(ITERS + 1)
        stamps[0] = time.perf_counter()
        for i in range(1, ITERS + 1):
            call()
            stamps[i] = time.perf_counter()
        return np.diff(stamps)

    def bare_torch(size: int) -> np.ndarray:
        t = torch.zeros(size // 4)
        t.copy_(pattern.values(pattern.Arrays("torch"), rank, 0, size // 4))
        for _ in range(W):
            dist.all_reduce(t)
        dist.barrier()
        return over_ranks(stamped(lambda: dist.all_reduce(t)))

    def bare_mpi(size: int) -> np.ndarray:
        r, s = np.zeros(size // 4, np.float32), np.zeros(size // 4, np.float32)
        s[:] = pattern.values(pattern.Arrays(), rank, 0, size // 4)
        for _ in range(W):
            comm.Allreduce(s, r, MPI.SUM)
        comm.Barrier()
        return over_ranks(stamped(lambda: comm.Allreduce(s, r, MPI.SUM)))

    def gbps(op: str, size: int, seconds: float) -> float:
        return size / 1e9 / seconds if op == "p2p" else busbw("all_reduce", size, seconds, n)

    pairs = {
        "mpi p2p pingpong GB/s (hpcdist vs mpi4py.bench pingpong)": ("p2p", ours_p2p, peer_p2p, p2p_sizes),
        "gloo all_reduce busbw GB/s (hpcdist vs bare torch.distributed loop)":
            ("all_reduce", ours_allreduce(tp, IN_PLACE), bare_torch, ar_sizes),
        "mpi all_reduce busbw GB/s (hpcdist vs bare mpi4py Allreduce loop)":
            ("all_reduce", ours_allreduce(mp, OUT_OF_PLACE), bare_mpi, ar_sizes),
    }
    keys = dict(zip(("p2p", "gloo", "mpi"), list(pairs), strict=True))
    pairs = {keys[k]: pairs[keys[k]] for k in args.only.split(",")}
    # Both sides of a comparison run back to back at each size, in alternating order, so they
    # see the same machine (other work on a shared node moves both, not one).
    trials: dict[str, dict[int, list[Trial]]] = {k: {} for k in pairs}
    for trial in range(args.trials):
        for name, (op, ours, peer, sizes) in pairs.items():
            for k, size in enumerate(sizes):
                got = {}
                for fn in ((ours, peer) if (trial + k) % 2 == 0 else (peer, ours)):
                    comm.Barrier()
                    got[fn] = fn(size)
                trials[name].setdefault(size, []).append(Trial.of(got[ours], got[peer], partial(gbps, op, size)))

    # ---- per-iteration timing overhead: the timed loop around a call that does nothing
    def noop() -> None:
        return None

    reps = 200_000
    overheads, bare = [], []
    for _ in range(args.trials):
        overheads.append(float(host_timed(noop, reps).mean()) * 1e6)
        t0 = time.perf_counter()
        for _ in range(reps):
            noop()
        bare.append((time.perf_counter() - t0) / reps * 1e6)

    if rank == 0:
        report: dict[str, Any] = {"command": " ".join(sys.argv), "ranks": n, "trials": args.trials,
                                  "warmup": W, "iters": ITERS, "launcher": ctx.info.launcher, "results": {}}
        print(f"# hpcdist harness overhead: {n} ranks via {ctx.info.launcher}, {args.trials} trials, "
              f"{W} warm-up + {ITERS} timed iterations per size; hpcdist and peer: medians over trials of "
              f"the figure from the mean time (as nccl-tests); ratio: of those medians; paired: median over "
              f"trials of each trial's hpcdist / peer; min, max: of the per-trial ratios; p50 ratio: paired, "
              f"of the figure from each trial's median iteration; slow it.: iterations over 3x their trial's "
              f"median (hpcdist/peer; none in the p2p peer, which gives only its mean), load average "
              f"{os.getloadavg()[0]:.1f}")
        for name, per_size in trials.items():
            print(f"\n# {name}")
            print(f"# {'size':>6} {'hpcdist':>10} {'peer':>10} {'ratio':>7} {'paired':>7} {'min':>7} {'max':>7}"
                  f" {'p50 ratio':>9} {'slow it.':>9}")
            rows = {}
            for size in sorted(per_size):
                row = summary(per_size[size])
                rows[human_bytes(size)] = row
                print(f"  {human_bytes(size):>6} {row['hpcdist']:>10.3f} {row['peer']:>10.3f} {row['ratio']:>7.3f} "
                      f"{row['paired_ratio']:>7.3f} {min(row['trial_ratios']):>7.3f} {max(row['trial_ratios']):>7.3f}"
                      f" {row['p50_ratio']:>9.3f} {row['slow_ours']:>4.0%}/{row['slow_peer']:<4.0%}")
            report["results"][name] = rows
        ov, bl = statistics.median(overheads), statistics.median(bare)
        print(f"\n# per-iteration timing: {ov:.3f} us per iteration of hpcdist's timed loop around a no-op call, "
              f"{bl:.3f} us for a bare Python loop of the same call: overhead {ov - bl:.3f} us per iteration")
        report["timing_overhead_us"] = {"timed_loop": ov, "bare_loop": bl, "overhead": ov - bl}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    from hpcdist.runtime import group

    group.finish(store, ctx.info, ctx.timeout_s)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

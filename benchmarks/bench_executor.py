"""``hpcdist.Executor`` against submitit's own executor, on the same machine in the same run.

Three workloads of a trivial function (no torch), each timed for both executors in turn:
- 20 ``submit`` calls, then every result;
- ``map_array`` of 50 items, then every result;
- one ``submit`` to its result (median over `--trials`).
On the ``local`` site against ``submitit.LocalExecutor``; with ``--slurm`` on the project's
four-node cluster (``local-slurm``, srun without PMIx as the suite runs it) against
``submitit.AutoExecutor(cluster="slurm")`` on the same partition. Each prints seconds and the
ratio hpcdist / submitit (the goal: at most 1.2).

Run: .venv/bin/python benchmarks/bench_executor.py [--slurm] [--trials 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

import hpcdist


def double(x: int) -> int:
    return 2 * x


def executors(slurm: bool, root: Path) -> dict[str, Callable[[str], Any]]:
    """A fresh executor of each kind per workload, in its own folder."""
    sets = {f"site.storage.{k}": str(root / "hpcdist" / k) for k in ("results", "checkpoints", "scratch", "logs")}
    if slurm:
        def ours(tag: str) -> Any:
            return hpcdist.Executor(folder=root / "hpcdist" / tag / "%j", site="local-slurm", timeout_min=5,
                                    set={"site.launcher.args": [], **sets})

        def theirs(tag: str) -> Any:
            ex = submitit.AutoExecutor(root / "submitit" / tag / "%j", cluster="slurm")
            ex.update_parameters(timeout_min=5, slurm_partition="cpu")
            return ex
    else:
        def ours(tag: str) -> Any:
            return hpcdist.Executor(folder=root / "hpcdist" / tag / "%j", timeout_min=5, set=sets)

        def theirs(tag: str) -> Any:
            ex = submitit.LocalExecutor(root / "submitit" / tag / "%j")
            ex.update_parameters(timeout_min=5)
            return ex
    return {"hpcdist": ours, "submitit": theirs}


def one(ex: Any) -> list[int]:
    return [ex.submit(double, 21).result()]


def timed(run: Callable[[], list[int]], expected: list[int]) -> float:
    t0 = time.perf_counter()
    got = run()
    elapsed = time.perf_counter() - t0
    if got != expected:
        raise SystemExit(f"wrong results: {got[:5]}... expected {expected[:5]}...")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slurm", action="store_true", help="on the local Slurm cluster (local-slurm)")
    parser.add_argument("--trials", type=int, default=5, help="trials of the one-submit workload")
    args = parser.parse_args()
    shared = Path("/var/tmp/hpcdist-shared") if args.slurm else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="bench-executor-", dir=shared))
    makers = executors(args.slurm, root)
    rows: list[tuple[str, dict[str, float]]] = []
    for name, work in [
        ("20 submits, all results", lambda ex: [j.result() for j in [ex.submit(double, i) for i in range(20)]]),
        ("map_array of 50, all results", lambda ex: [j.result() for j in ex.map_array(double, range(50))]),
    ]:
        expected = [2 * i for i in range(50 if "50" in name else 20)]
        figures = {}
        for who, make in makers.items():  # in turn, the same workload
            ex = make(name.split()[0] + who)
            figures[who] = timed(functools.partial(work, ex), expected)
        rows.append((name, figures))
    singles: dict[str, list[float]] = {"hpcdist": [], "submitit": []}
    for trial in range(args.trials):
        for who, make in makers.items():
            singles[who].append(timed(functools.partial(one, make(f"one{trial}{who}")), [42]))
    rows.append((f"one submit to its result (median of {args.trials})",
                 {who: statistics.median(v) for who, v in singles.items()}))
    where = "local-slurm (4 nodes on this machine)" if args.slurm else "the local site (processes on this machine)"
    print(f"hpcdist.Executor vs submitit {submitit.__version__} on {where}; Python {sys.version.split()[0]}")
    print(f"{'workload':<44} {'hpcdist s':>10} {'submitit s':>11} {'ratio':>7}")
    for name, fig in rows:
        print(f"{name:<44} {fig['hpcdist']:10.2f} {fig['submitit']:11.2f} {fig['hpcdist'] / fig['submitit']:7.2f}")


if __name__ == "__main__":
    main()

"""The collectives sweep: every operation, over a range of sizes, on each path and mode.

For each (path, operation, mode, size) every rank warms up, times the iterations, checks the
data, and sends its figures to rank 0, which adds a row and rewrites the result file; a rank
that fails mid-sweep leaves the rows before it, marked incomplete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpcdist.bench.bandwidth import DTYPE_BYTES, bus_factor, counts, human_bytes, parse_size
from hpcdist.bench.base import IN_PLACE, modes_for
from hpcdist.bench.measure import measure, summarize
from hpcdist.bench.session import Session
from hpcdist.console import Progress

if TYPE_CHECKING:
    from hpcdist.bench.params import CollectivesParams
    from hpcdist.runtime.job_rank import JobRank


def table_name(op: str, path: str) -> str:
    return f"bench/{op}/{path}"


def sweep_collectives(s: Session, ops: tuple[str, ...], sizes: list[int], params: Any) -> list[str]:
    """Measure `ops` over `sizes` on every path of the session; returns the shortfalls."""
    ctx, n = s.ctx, s.ctx.world_size
    itemsize = DTYPE_BYTES[params.dtype]
    plan = []
    for path in s.paths:
        for op in ops:
            for mode in modes_for(path.name, op, params.modes):
                for size in [0] if op == "barrier" else sizes:
                    c = counts(op, size, n, itemsize)
                    if op != "barrier" and c.count == 0:
                        continue  # smaller than one element per rank
                    plan.append((path, op, mode, size, c))
    with Progress("collectives", len(plan), show=s.ctx.is_main, transient=True) as bar:
        for path, op, mode, size, c in plan:
            name = table_name(op, path.name)
            exp, exp_label = s.expected(op)
            if s.record is not None:
                s.record.table(
                    name, op=op, path=path.name, label=path.label, dtype=params.dtype, nranks=n,
                    bus_factor=bus_factor(op, n), warmup=params.warmup, iters=params.iters, fraction_of=exp_label,
                )
            what = f"{op} at size {size} B ({human_bytes(size)}) on path {path.label} ({mode})"
            got = s.run_one(
                path, what, op, size,
                lambda path=path, op=op, c=c, mode=mode: measure(  # type: ignore[misc]
                    path, op, c, mode, params.dtype, params.warmup, params.iters, params.check
                ),
            )
            if s.record is not None and got is not None:
                row = summarize(op, c, mode == IN_PLACE, got, list(range(n)), s.node_of_rank, n, exp)
                s.record.add_row(name, row)
                s.record.flush(complete=False)
                if row["wrong"]:
                    ctx.log.warning("%s: %d wrong elements", what, row["wrong"])
            bar.advance(f"{op} {human_bytes(size)} {path.label}")
    return shortfalls(s, ops) if s.record is not None else []


def shortfalls(s: Session, ops: tuple[str, ...]) -> list[str]:
    """Operations whose bus bandwidth is below the site's minimum (rank 0).

    A minimum of one figure is a peak, so it is compared with the best mode at the largest size
    measured (averaging over a sweep that starts at 8 bytes would always fall short); a minimum
    per size is compared at each of its sizes that was measured, and at no other: a 16 MB
    all_reduce across nodes is latency-bound and never reaches the figure of 8 GB.
    """
    assert s.record is not None
    base = s.ctx.site.baselines
    out = []
    for op in ops:
        floors = base.min_busbw_gbps.get(op)
        if floors is None:
            continue
        for path in s.paths:
            table = s.record.tables.get(table_name(op, path.name))
            if table is None or not table.rows:
                continue
            sizes = {r["size"] for r in table.rows}
            if isinstance(floors, dict):
                checks = sorted((parse_size(k), v) for k, v in floors.items() if parse_size(k) in sizes)
            else:
                checks = [(max(sizes), floors)]
            for size, floor in checks:
                best = max((r for r in table.rows if r["size"] == size), key=lambda r: r["busbw_gbps"])
                if not best["busbw_gbps"] >= floor:
                    out.append(
                        f"{op} on {path.label}: busbw {best['busbw_gbps']:.2f} GB/s at {human_bytes(size)} < minimum "
                        f"{floor:g} GB/s (slowest rank {best['slowest_rank']} on {best['slowest_host']})"
                    )
    return out


def run(ctx: JobRank, params: CollectivesParams) -> dict[str, Any]:
    """Job kind ``bench_collectives``."""
    s = Session(ctx, params)
    found = sweep_collectives(s, tuple(params.ops), params.sizes(), params)
    out = s.finish(found, params.enforce_minimums)
    if s.record is not None:
        out["peak_busbw_gbps"] = {
            name.split("/")[1] + "/" + name.split("/")[2]: round(max((r["busbw_gbps"] for r in t.rows), default=0.0), 3)
            for name, t in s.record.tables.items()
            if not name.startswith("bench/barrier")
        }
    return out

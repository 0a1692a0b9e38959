"""The preflight: a check that takes seconds, run first in a training allocation.

all_reduce at a few large sizes on each path, then (on two nodes or more) the node-pair
matrix at one size. Every figure is compared with the site's ``baselines``; below a minimum the
job fails on every rank (non-zero exit, like nccl-tests' minimum-bandwidth check) with a message
that names the nodes that fell short. The figures are kept in the result file either way.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from hpcdist.bench.base import IN_PLACE, OUT_OF_PLACE
from hpcdist.bench.collectives import sweep_collectives
from hpcdist.bench.pairs import sweep_pairs
from hpcdist.bench.session import Session

if TYPE_CHECKING:
    from hpcdist.bench.jobs import PreflightParams
    from hpcdist.runtime.context import JobContext


def run(ctx: JobContext, params: PreflightParams) -> dict[str, Any]:
    """Job kind ``bench_preflight``."""
    s = Session(ctx, params)
    sweep = SimpleNamespace(
        dtype=params.dtype, modes=(OUT_OF_PLACE, IN_PLACE), warmup=params.warmup, iters=params.iters,
        check=params.check,
    )
    found = sweep_collectives(s, ("all_reduce",), sorted(params.sizes_bytes), sweep)
    if len(s.nodes) > 1:
        pair_params = SimpleNamespace(
            size=params.pair_size, latency_size=params.latency_size, window=params.window,
            iters=params.iters, warmup=params.warmup,
        )
        found += sweep_pairs(s, pair_params)
    wrong = 0
    if s.record is not None:
        wrong = sum(r["wrong"] for t in s.record.tables.values() for r in t.rows)
        if wrong:
            found.append(f"{wrong} wrong elements in the all_reduce data check")
    out = s.finish(found, enforce=True)
    if s.record is not None:
        out["all_reduce_busbw_gbps"] = {
            n.split("/")[2]: round(max(r["busbw_gbps"] for r in t.rows), 3) for n, t in s.record.tables.items()
        }
    return out

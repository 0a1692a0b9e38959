"""The preflight: a check that takes seconds, run first in a training allocation.

all_reduce at a few large sizes on each path, then (on two nodes or more) the node-pair
matrix at one size. Every figure is compared with the site's ``baselines``; below a minimum the
job fails on every rank (non-zero exit, like nccl-tests' minimum-bandwidth check) with a message
that names the nodes that fell short. The figures are kept in the result file either way.

A node every one of whose links fell short (on three nodes or more: on two, either end could be
the cause) is marked bad in the site's node health record (``hpcdist.store.records.health``), once, by
rank 0, so every later submission excludes it. ``on_slow: stop`` (the default) then fails the
job, saying that a resubmission runs without the node; ``continue`` marks it and goes on.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from hpcdist.bench.base import IN_PLACE, OUT_OF_PLACE
from hpcdist.bench.collectives import sweep_collectives
from hpcdist.bench.pairs import culprits, sweep_pairs
from hpcdist.bench.session import Session
from hpcdist.errors import HpcdistError

if TYPE_CHECKING:
    from hpcdist.bench.params import PreflightParams
    from hpcdist.runtime.job_rank import JobRank


def run(ctx: JobRank, params: PreflightParams) -> dict[str, Any]:
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
    if s.record is not None:
        found += _mark_slow_nodes(s)
    wrong = 0
    if s.record is not None:
        wrong = sum(r["wrong"] for t in s.record.tables.values() for r in t.rows)
        if wrong:
            found.append(f"{wrong} wrong elements in the all_reduce data check")
    out = s.finish(found, enforce=params.on_slow == "stop")
    if s.record is not None:
        out["all_reduce_busbw_gbps"] = {
            n.split("/")[2]: round(max(r["busbw_gbps"] for r in t.rows), 3) for n, t in s.record.tables.items()
        }
    return out


def _mark_slow_nodes(s: Session) -> list[str]:
    """Rank 0: mark each node the pair matrices blame alone; what it marked, for the verdict."""
    from hpcdist.store.records import health

    assert s.record is not None
    base = s.ctx.site.baselines
    slow: dict[str, str] = {}
    for m in s.record.matrices.values():
        for node, why in culprits(m, base.min_p2p_gbps, base.max_latency_us).items():
            slow.setdefault(node, why)
    if not slow:
        return []
    marked, failed = [], []
    for node, why in slow.items():
        try:
            health.mark(s.ctx.site, node, why, job_id=s.ctx.job_id, source="preflight")
            marked.append(node)
        except (OSError, HpcdistError) as exc:  # the verdict says so; the figures matter more
            failed.append(f"{node} ({exc})")
    hours = s.ctx.site.health.exclude_for_h
    said = []
    it = "them" if len(marked) > 1 else "it"
    if marked:
        then = (f"submissions exclude {it} for {hours:g} h, so a resubmission runs without {it}" if hours > 0 else
                f"the site's health.exclude_for_h is 0, so submissions do not exclude {it}")
        said.append(f"marked {', '.join(marked)} bad in the site's node health record ({health.folder(s.ctx.site)}): "
                    f"{then} (`hpcdist nodes` lists the marks)")
    if failed:
        said.append(f"could not mark {', '.join(failed)} in the site's node health record")
    return said

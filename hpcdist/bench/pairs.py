"""The node-pair matrix: every pair of nodes, one rank each, in rounds where no node is in two
pairs at once, so a slow node or link shows up as a row (or column) of the heat map.

Rounds follow the circle method of a round-robin tournament: n nodes take n-1 rounds (n even)
or n (odd, one node rests each round). In each round every pair measures unidirectional
bandwidth both ways and the ping-pong latency; the first rank of each node speaks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.bench.base import CommPath
from hpcdist.bench.factors import algbw, human_bytes
from hpcdist.bench.p2p import exchange
from hpcdist.bench.record import Matrix
from hpcdist.bench.session import Session
from hpcdist.console import Progress

if TYPE_CHECKING:
    from hpcdist.bench.jobs import PairsParams
    from hpcdist.runtime.context import JobContext


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """Pairs of node indices per round; every pair exactly once, no index twice in a round."""
    ids: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(ids)
    out: list[list[tuple[int, int]]] = []
    for _ in range(m - 1):
        pairs = []
        for k in range(m // 2):
            a, b = ids[k], ids[m - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        out.append(sorted(pairs))
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return out


def measure_pairs(s: Session, path: CommPath, params: Any) -> Matrix:
    """Every node pair on `path`; rank 0 gets the matrices, other ranks an empty one."""
    nodes = s.nodes
    n = len(nodes)
    leader = {i: s.node_of_rank.index(node) for i, node in enumerate(nodes)}
    me = s.rank
    bw = np.full((n, n), np.nan)
    lat = np.full((n, n), np.nan)
    schedule = rounds(n)
    with Progress(f"pairs {path.label}", len(schedule), show=s.ctx.is_main, transient=True) as bar:
        for k, pairs in enumerate(schedule):
            what = (
                f"pairs round {k + 1}/{len(schedule)} ({', '.join(f'{nodes[i]}<->{nodes[j]}' for i, j in pairs)}) "
                f"at size {params.size} B ({human_bytes(params.size)}) on path {path.label}"
            )

            def one(pairs: list[tuple[int, int]] = pairs) -> list[tuple[str, int, int, float]] | None:
                for i, j in pairs:
                    if me not in (leader[i], leader[j]):
                        continue
                    first = me == leader[i]
                    peer = leader[j] if first else leader[i]
                    go = exchange(path, "unidir", me, peer, first, params.size, params.warmup, params.iters,
                                  params.window, False)
                    back = exchange(path, "unidir", me, peer, not first, params.size, params.warmup, params.iters,
                                    params.window, False)
                    ping = exchange(path, "pingpong", me, peer, first, params.latency_size, params.warmup,
                                    params.iters, 1, False)
                    if first:  # each direction is reported by its sender
                        return [
                            ("bw", i, j, algbw(params.size, float(go.times.mean()))),
                            ("lat", i, j, float(ping.times.mean()) * 1e6),
                        ]
                    return [("bw", j, i, algbw(params.size, float(back.times.mean())))]
                return None

            got = s.run_one(path, what, "pairs", params.size, one)
            for cells in got or []:
                for kind, i, j, value in cells or []:
                    if kind == "bw":
                        bw[i, j] = value
                    else:
                        lat[i, j] = lat[j, i] = value
            bar.advance(f"round {k + 1}")
    exp, label = s.expected("pairs")
    frac = bw / exp if exp else np.full((n, n), np.nan)
    attrs = {
        "size": params.size, "latency_size": params.latency_size, "iters": params.iters, "warmup": params.warmup,
        "window": params.window, "rounds": len(schedule), "fraction_of": label, "label": path.label,
        "leaders": np.array([leader[i] for i in range(n)], dtype=np.int32),
        # the site's minimum, so a report can mark the slow pairs (NaN: the site sets none)
        "min_gbps": np.nan if s.ctx.site.baselines.min_p2p_gbps is None else s.ctx.site.baselines.min_p2p_gbps,
    }
    return Matrix(list(nodes), bw, lat, frac, attrs)


def pair_shortfalls(m: Matrix, min_gbps: float | None, max_latency_us: float | None) -> list[str]:
    """Links below the minimum, and the nodes in the most of them (the likely culprits)."""
    bad: list[str] = []
    blame: dict[str, int] = {}
    n = len(m.nodes)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if min_gbps is not None and not m.bandwidth[i, j] >= min_gbps:
                bad.append(f"{m.nodes[i]}->{m.nodes[j]} {m.bandwidth[i, j]:.3g} GB/s")
                blame[m.nodes[i]] = blame.get(m.nodes[i], 0) + 1
                blame[m.nodes[j]] = blame.get(m.nodes[j], 0) + 1
            if max_latency_us is not None and i < j and not m.latency[i, j] <= max_latency_us:
                bad.append(f"{m.nodes[i]}<->{m.nodes[j]} latency {m.latency[i, j]:.1f} us")
                blame[m.nodes[i]] = blame.get(m.nodes[i], 0) + 1
                blame[m.nodes[j]] = blame.get(m.nodes[j], 0) + 1
    if not bad:
        return []
    worst = sorted(blame, key=lambda h: (-blame[h], h))
    limits = []
    if min_gbps is not None:
        limits.append(f"minimum {min_gbps:g} GB/s")
    if max_latency_us is not None:
        limits.append(f"maximum {max_latency_us:g} us")
    return [
        f"node pairs on {m.attrs['label']} short of the site's {' and '.join(limits)}: {', '.join(bad)}; "
        f"nodes that fell short: {', '.join(f'{h} ({blame[h]} links)' for h in worst)}"
    ]


def culprits(m: Matrix, min_gbps: float | None, max_latency_us: float | None) -> dict[str, str]:
    """The nodes every one of whose links fell short (either way), each with why: the node, not
    a link or the baseline. None on two nodes (a slow link cannot be pinned on either end), and
    none when every node is in that state (the baseline, or the whole fabric, is the cause)."""
    n = len(m.nodes)
    if n < 3:
        return {}

    def short(i: int, j: int) -> str:
        why = [f"{m.nodes[a]}->{m.nodes[b]} {m.bandwidth[a, b]:.3g} GB/s" for a, b in ((i, j), (j, i))
               if min_gbps is not None and not m.bandwidth[a, b] >= min_gbps]
        if max_latency_us is not None and not m.latency[min(i, j), max(i, j)] <= max_latency_us:
            why.append(f"{m.nodes[i]}<->{m.nodes[j]} latency {m.latency[min(i, j), max(i, j)]:.1f} us")
        return ", ".join(why)

    found = {}
    for i in range(n):
        links = [short(i, j) for j in range(n) if j != i]
        if all(links):
            found[m.nodes[i]] = (f"every link of {m.nodes[i]} on {m.attrs['label']} short of the site's baselines: "
                                 + ", ".join(links))
    return {} if len(found) == n else found


def sweep_pairs(s: Session, params: Any) -> list[str]:
    """The node-pair matrix on every path, each kept in the result as soon as it is measured;
    returns what fell short of the site's baselines."""
    found: list[str] = []
    base = s.ctx.site.baselines
    for path in s.paths:
        m = measure_pairs(s, path, params)
        if s.record is not None:
            s.record.matrices[f"pairs/{path.name}"] = m
            s.record.flush(complete=False)
            found += pair_shortfalls(m, base.min_p2p_gbps, base.max_latency_us)
    return found


def run(ctx: JobContext, params: PairsParams) -> dict[str, Any]:
    """Job kind ``bench_pairs``."""
    s = Session(ctx, params)
    out = s.finish(sweep_pairs(s, params), params.enforce_minimums)
    if s.record is not None:
        out["pairs"] = {
            name: {f"{m.nodes[i]}->{m.nodes[j]}": round(float(m.bandwidth[i, j]), 3)
                   for i in range(len(m.nodes)) for j in range(len(m.nodes)) if i != j}
            for name, m in s.record.matrices.items()
        }
    return out

"""The node-pair matrix: every pair of nodes, every rail, in rounds where no node is in two pairs
at once, so a slow node, link or rail shows up as a row (or column) of the heat map.

Rounds follow the circle method of a round-robin tournament: n nodes take n-1 rounds (n even)
or n (odd, one node rests each round). In each round every pair measures unidirectional
bandwidth both ways and the ping-pong latency on each rail: local rank r of one node with local
rank r of the other (a rail-optimised node has one NIC per GPU, GPU r's the r-th of the site's
``network.ib_hcas``). A pair's rails run at once, as training drives them (NCCL spreads a
collective over every NIC), which keeps the job's time that of one rail and shows a rail that is
slow only under load (a shared PCIe switch, an uplink); each rail's figure is its own. The node
pair's figure is its slowest rail's bandwidth (and highest latency), so a slow rail marks the
pair, and its node, as a slow link always did, and the shortfall names the rail.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.bench.bandwidth import algbw, human_bytes
from hpcdist.bench.base import CommPath
from hpcdist.bench.p2p import exchange
from hpcdist.bench.record import Matrix
from hpcdist.bench.session import Session
from hpcdist.console import Progress

if TYPE_CHECKING:
    from hpcdist.bench.params import PairsParams
    from hpcdist.runtime.job_rank import JobRank


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


def rail_ranks(node_of_rank: list[str], nodes: list[str]) -> list[list[int]]:
    """``[rail][node index]`` -> rank: local rank r of each node is rail r; as many rails as the
    node with the fewest ranks has (one rank each: one rail, the nodes' first ranks)."""
    ranks = [[r for r, node in enumerate(node_of_rank) if node == name] for name in nodes]
    return [[mine[k] for mine in ranks] for k in range(min(len(mine) for mine in ranks))]


def rail_names(count: int, hcas: tuple[str, ...]) -> list[str]:
    """``rail 0 (mlx5_0)``...: the local rank, and the HCA the site lists for it when it lists one."""
    return [f"rail {k}" + (f" ({hcas[k]})" if k < len(hcas) and count > 1 else "") for k in range(count)]


def measure_pairs(s: Session, path: CommPath, params: Any) -> Matrix:
    """Every node pair on `path`, all rails of a pair at once; rank 0 gets the matrices, other
    ranks an empty one."""
    nodes = s.nodes
    n = len(nodes)
    rails = rail_ranks(list(s.node_of_rank), list(nodes))
    me = s.rank
    bw = np.full((len(rails), n, n), np.nan)
    lat = np.full((len(rails), n, n), np.nan)
    schedule = rounds(n)
    with Progress(f"pairs {path.label}", len(schedule), show=s.ctx.is_main, transient=True) as bar:
        for k, pairs in enumerate(schedule):
            what = (
                f"pairs round {k + 1}/{len(schedule)} ({', '.join(f'{nodes[i]}<->{nodes[j]}' for i, j in pairs)}"
                f"{f', {len(rails)} rails each' if len(rails) > 1 else ''}) "
                f"at size {params.size} B ({human_bytes(params.size)}) on path {path.label}"
            )

            def one(pairs: list[tuple[int, int]] = pairs) -> list[tuple[str, int, int, int, float]] | None:
                for (i, j), (r, ranks) in ((p, rail) for p in pairs for rail in enumerate(rails)):
                    if me not in (ranks[i], ranks[j]):
                        continue
                    first = me == ranks[i]
                    peer = ranks[j] if first else ranks[i]
                    go = exchange(path, "unidir", me, peer, first, params.size, params.warmup, params.iters,
                                  params.window, False)
                    back = exchange(path, "unidir", me, peer, not first, params.size, params.warmup, params.iters,
                                    params.window, False)
                    ping = exchange(path, "pingpong", me, peer, first, params.latency_size, params.warmup,
                                    params.iters, 1, False)
                    if first:  # each direction is reported by its sender
                        return [
                            ("bw", r, i, j, algbw(params.size, float(go.times.mean()))),
                            ("lat", r, i, j, float(ping.times.mean()) * 1e6),
                        ]
                    return [("bw", r, j, i, algbw(params.size, float(back.times.mean())))]
                return None

            got = s.run_one(path, what, "pairs", params.size, one)
            for cells in got or []:
                for kind, r, i, j, value in cells or []:
                    if kind == "bw":
                        bw[r, i, j] = value
                    else:
                        lat[r, i, j] = lat[r, j, i] = value
            bar.advance(f"round {k + 1}")
    exp, label = s.expected("pairs")
    slowest = _slowest(bw, np.fmin)
    frac = slowest / exp if exp else np.full((n, n), np.nan)
    attrs = {
        "size": params.size, "latency_size": params.latency_size, "iters": params.iters, "warmup": params.warmup,
        "window": params.window, "rounds": len(schedule), "fraction_of": label, "label": path.label,
        "leaders": np.array(rails[0], dtype=np.int32),
        "rail_ranks": np.array(rails, dtype=np.int32),
        # the site's minimum, so a report can mark the slow pairs (NaN: the site sets none)
        "min_gbps": np.nan if s.ctx.site.baselines.min_p2p_gbps is None else s.ctx.site.baselines.min_p2p_gbps,
    }
    return Matrix(list(nodes), slowest, _slowest(lat, np.fmax), frac, attrs,
                  rails=rail_names(len(rails), s.ctx.site.network.ib_hcas), rail_bandwidth=bw, rail_latency=lat)


def _slowest(per_rail: np.ndarray, pick: Any) -> np.ndarray:
    """The node pair's figure from its rails' (`np.fmin` for bandwidth, `np.fmax` for latency; a
    rail not measured is skipped, none measured stays NaN)."""
    return np.asarray(pick.reduce(per_rail, axis=0), dtype=float)


def _short_links(m: Matrix, i: int, j: int, min_gbps: float) -> list[str]:
    """``n1->n2 3.1 GB/s``, or per slow rail ``n1->n2 rail 2 (mlx5_4) 3.1 GB/s`` when there are rails."""
    if m.rail_bandwidth is None or len(m.rails) < 2:
        return [] if m.bandwidth[i, j] >= min_gbps else [f"{m.nodes[i]}->{m.nodes[j]} {m.bandwidth[i, j]:.3g} GB/s"]
    return [f"{m.nodes[i]}->{m.nodes[j]} {name} {m.rail_bandwidth[r, i, j]:.3g} GB/s"
            for r, name in enumerate(m.rails) if not m.rail_bandwidth[r, i, j] >= min_gbps]


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
                bad += _short_links(m, i, j, min_gbps)
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
        why = [w for a, b in ((i, j), (j, i)) if min_gbps is not None for w in _short_links(m, a, b, min_gbps)]
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


def run(ctx: JobRank, params: PairsParams) -> dict[str, Any]:
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

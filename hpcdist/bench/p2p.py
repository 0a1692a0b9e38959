"""Point to point between two ranks: ping-pong latency, unidirectional and bidirectional bandwidth.

- ``pingpong``: one message there and back; the time is half the round trip (as
  ``mpi4py.bench pingpong`` and osu_latency), the bandwidth the size over that time.
- ``unidir``: a window of non-blocking sends answered by one small acknowledgement (osu_bw);
  the time is per message.
- ``bidir``: both ranks send a window to each other at once (osu_bibw); the time is per pair
  of messages and the bandwidth counts both directions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.bench import pattern
from hpcdist.bench.bandwidth import Counts, human_bytes
from hpcdist.bench.base import CommPath
from hpcdist.bench.measure import Local, summarize
from hpcdist.bench.session import Session
from hpcdist.console import Progress

if TYPE_CHECKING:
    from hpcdist.bench.params import P2PParams
    from hpcdist.runtime.job_rank import JobRank

# Bytes that cross the link per timed unit, as a multiple of the message size.
DIRECTIONS = {"pingpong": 1, "unidir": 1, "bidir": 2}


def exchange(
    path: CommPath, test: str, me: int, peer: int, first: bool, nbytes: int, warmup: int, iters: int,
    window: int, check: bool,
) -> Local:
    """Run `test` between this rank and `peer`; `first` is the side that starts (sends)."""
    buf = path.bytes_buffer(nbytes)
    # separate send and receive buffers, as osu_latency/osu_bibw and mpi4py.bench do
    rbuf = path.bytes_buffer(nbytes) if test in ("bidir", "pingpong") else buf
    ack = path.bytes_buffer(1)
    if test == "pingpong":
        if first:
            def step() -> None:
                path.send(buf, peer)
                path.recv(rbuf, peer)
        else:
            def step() -> None:
                path.recv(rbuf, peer)
                path.send(buf, peer)
        per = 2.0  # two one-way trips per iteration
    elif test == "unidir":
        if first:
            def step() -> None:
                path.wait_all([path.isend(buf, peer) for _ in range(window)])
                path.recv(ack, peer)
        else:
            def step() -> None:
                path.wait_all([path.irecv(buf, peer) for _ in range(window)])
                path.send(ack, peer)
        per = float(window)
    elif test == "bidir":
        def step() -> None:
            path.exchange(buf, rbuf, peer, window)
        per = float(window)
    else:
        raise ValueError(f"unknown point-to-point test {test!r}")
    for _ in range(warmup):
        step()
    path.sync()
    times = path.timed(step, iters) / per
    wrong = 0
    if check:  # one plain message from the first rank, checked on the other
        ax = path.arrays()
        if first:
            buf[:] = pattern.values(ax, me, 0, nbytes)
            path.sync()  # a GPU buffer is written on a stream; MPI must not read it before
            path.send(buf, peer)
        else:
            path.recv(buf, peer)
            path.sync()
            wrong = ax.count_wrong(buf, pattern.values(ax, peer, 0, nbytes), exact=True)
    return Local(times, wrong)


def table_name(test: str, path: str) -> str:
    return f"bench/p2p_{test}/{path}"


def run(ctx: JobRank, params: P2PParams) -> dict[str, Any]:
    """Job kind ``bench_p2p``: the tests between two ranks (by default the first and the last)."""
    s = Session(ctx, params)
    a, b = params.ranks if params.ranks is not None else (0, ctx.world_size - 1)
    me = ctx.rank
    plan = [(path, test, size) for path in s.paths for test in params.tests for size in params.sizes()]
    title = f"p2p {s.node_of_rank[a]} <-> {s.node_of_rank[b]}"
    with Progress(title, len(plan), show=s.ctx.is_main, transient=True) as bar:
        for path, test, size in plan:
            name = table_name(test, path.name)
            exp, exp_label = s.expected("p2p")
            if s.record is not None:
                s.record.table(
                    name, op=f"p2p_{test}", path=path.name, label=path.label, dtype="uint8", nranks=2,
                    bus_factor=1.0, warmup=params.warmup, iters=params.iters, fraction_of=exp_label,
                    ranks=np.array([a, b], dtype=np.int32), window=params.window if test != "pingpong" else 1,
                )
            what = f"p2p {test} at size {size} B ({human_bytes(size)}) between ranks {a} and {b} on path {path.label}"

            def one(path: CommPath = path, test: str = test, size: int = size) -> Local | None:
                if me not in (a, b):
                    return None
                return exchange(
                    path, test, me, b if me == a else a, me == a, size, params.warmup, params.iters,
                    params.window, params.check,
                )

            got = s.run_one(path, what, f"p2p_{test}", size, one)
            if s.record is not None and got is not None:
                locs = [got[a], got[b]]
                c = Counts(size, size, size, size)
                row = summarize(test, c, False, locs, [a, b], s.node_of_rank, 2, exp, DIRECTIONS[test] * size)
                s.record.add_row(name, row)
                s.record.flush(complete=False)
            bar.advance(f"{test} {human_bytes(size)} {path.label}")
    found = p2p_shortfalls(s, params.tests, a, b) if s.record is not None else []
    out = s.finish(found, params.enforce_minimums)
    if s.record is not None:
        out["peak_gbps"] = {
            n.split("/", 1)[1]: round(max((r["algbw_gbps"] for r in t.rows), default=0.0), 3)
            for n, t in s.record.tables.items()
        }
    return out


def p2p_shortfalls(s: Session, tests: tuple[str, ...], a: int, b: int) -> list[str]:
    """Bandwidth at the largest size below ``min_p2p_gbps``, latency at the smallest above ``max_latency_us``."""
    assert s.record is not None
    base = s.ctx.site.baselines
    link = f"{s.node_of_rank[a]}->{s.node_of_rank[b]}"
    found: list[str] = []
    for path in s.paths:
        for test in tests:
            table = s.record.tables.get(table_name(test, path.name))
            if table is None or not table.rows:
                continue
            top = max(table.rows, key=lambda r: r["size"])
            floor = base.min_p2p_gbps
            if test in ("unidir", "pingpong") and floor is not None and not top["algbw_gbps"] >= floor:
                found.append(
                    f"p2p {test} {link} on {path.label}: {top['algbw_gbps']:.2f} GB/s at "
                    f"{human_bytes(top['size'])} < minimum {floor:g} GB/s"
                )
            small = min(table.rows, key=lambda r: r["size"])
            ceiling = base.max_latency_us
            if test == "pingpong" and ceiling is not None and not small["time_us"] <= ceiling:
                found.append(
                    f"p2p latency {link} on {path.label}: {small['time_us']:.1f} us at "
                    f"{human_bytes(small['size'])} > maximum {ceiling:g} us"
                )
    return found

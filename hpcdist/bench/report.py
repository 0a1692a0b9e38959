"""Reading a benchmark result file back: an nccl-tests-style table, PNG plots, and a side by
side comparison of two runs (this allocation against last week's).

Only h5py, NumPy and (for plots) matplotlib: a report runs on a laptop without torch or MPI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcdist.bench.factors import COLLECTIVES, P2P_TESTS, human_bytes
from hpcdist.errors import BenchmarkError


@dataclass
class Table:
    op: str
    path: str
    attrs: dict[str, Any]
    cols: dict[str, np.ndarray]


@dataclass
class Result:
    """A benchmark result file, read back."""

    file: Path
    attrs: dict[str, Any]
    tables: list[Table] = field(default_factory=list)
    matrices: dict[str, dict[str, Any]] = field(default_factory=dict)
    interconnect: dict[str, np.ndarray] = field(default_factory=dict)

    def table(self, op: str, path: str) -> Table | None:
        return next((t for t in self.tables if t.op == op and t.path == path), None)


def load(file: str | Path) -> Result:
    """The result at `file`; a missing or foreign file is a BenchmarkError saying so."""
    import h5py

    from hpcdist.store.results import read_table
    from hpcdist.store.tree import plain as _plain

    file = Path(file)
    if not file.is_file():
        raise BenchmarkError(f"result file {str(file)!r} does not exist; `hpcdist submit` prints where a result lands")
    try:
        f = h5py.File(file, "r")
    except OSError as exc:
        raise BenchmarkError(f"{file} is not an HDF5 file ({exc})") from None
    with f:
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
        if attrs.get("format") != "hpcdist.result" or "bench_layout" not in attrs:
            raise BenchmarkError(
                f"{file} is not an hpcdist benchmark result (format {attrs.get('format')!r}, "
                f"kind {attrs.get('kind')!r}); pass a file written by a bench_* job"
            )
        out = Result(file, attrs)
        order = {op: i for i, op in enumerate([*COLLECTIVES, *(f"p2p_{t}" for t in P2P_TESTS)])}
        for op in sorted(f.get("bench", {}), key=lambda o: (order.get(o, len(order)), o)):
            for path in sorted(f["bench"][op]):
                g = f["bench"][op][path]
                out.tables.append(Table(op, path, {k: _plain(v) for k, v in g.attrs.items()}, read_table(g)))
        for path in sorted(f.get("pairs", {})):
            g = f["pairs"][path]
            out.matrices[path] = {
                "nodes": [n.decode() if isinstance(n, bytes) else str(n) for n in g["nodes"][()]],
                "bandwidth_gbps": g["bandwidth_gbps"][()],
                "latency_us": g["latency_us"][()],
                "fraction": g["fraction"][()],
                **{k: _plain(v) for k, v in g.attrs.items()},
            }
        if "interconnect" in f:
            out.interconnect = read_table(f["interconnect"])
    return out


def _f(x: float, width: int, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a".rjust(width)
    return f"{x:{width}.{digits}f}"


def header(r: Result) -> list[str]:
    a = r.attrs
    nodes = a.get("nodes") or []
    lines = [
        f"# {a.get('kind')} {a.get('job_name')} job {a.get('job_id')} on site {a.get('site')}, {a.get('created')}",
        f"# {a.get('world_size')} ranks on {len(nodes)} node(s): {', '.join(nodes)}; "
        f"paths {', '.join(a.get('paths') or [])}",
        f"# hpcdist {a.get('version_hpcdist')}, torch {a.get('version_torch')}, NCCL {a.get('version_nccl')}, "
        f"MPI {a.get('version_mpi')}",
    ]
    ib = r.interconnect
    if ib and len(ib.get("host", [])):
        ports = {f"{h}:{d}/{p} {s} {ll} {rate}" for h, d, p, s, ll, rate in zip(
            ib["host"], ib["device"], ib["port"], ib["state"], ib["link_layer"], ib["rate"], strict=True)}
        lines.append(f"# InfiniBand: {'; '.join(sorted(ports))}")
    else:
        lines.append("# InfiniBand: none found on the nodes")
    if not a.get("complete"):
        lines.append("# INCOMPLETE: the run stopped early; the rows below are those measured before it did")
    lines.append(f"# verdict: {a.get('verdict')}")
    return lines


def collective_lines(t: Table) -> list[str]:
    """One nccl-tests-like block: out-of-place and in-place side by side, then p50/p99/slowest."""
    c = t.cols
    a = t.attrs
    lines = [
        "",
        f"# {t.op} on {a.get('label', t.path)}, {a.get('nranks')} ranks, {a.get('dtype')}, "
        f"{a.get('warmup')} warm-up + {a.get('iters')} timed iterations; busbw factor {a.get('bus_factor', 1):.3f}",
        f"# fraction of: {a.get('fraction_of')}",
        "#" + " " * 25 + "out-of-place".center(36) + " " + "in-place".center(36),
        f"# {'size':>10} {'count':>11}  {'time(us)':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>7}  "
        f"{'time(us)':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>7}  {'p50(us)':>9} {'p99(us)':>9} "
        f"{'slowest':>12} {'frac':>6}",
    ]
    sizes = sorted(set(c["size"].tolist()))
    busbws = []
    for size in sizes:
        rows = {int(ip): i for i, (s, ip) in enumerate(zip(c["size"], c["in_place"], strict=True)) if s == size}
        parts = []
        for mode in (0, 1):
            i = rows.get(mode)
            if i is None:
                parts.append(f"{'':>9} {'':>8} {'':>8} {'':>7}")
                continue
            busbws.append(c["busbw_gbps"][i])
            parts.append(
                f"{_f(c['time_us'][i], 9)} {_f(c['algbw_gbps'][i], 8)} {_f(c['busbw_gbps'][i], 8)} {c['wrong'][i]:>7d}"
            )
        i = rows.get(0, rows.get(1))
        assert i is not None
        slowest = f"{c['slowest_rank'][i]}@{c['slowest_host'][i]}"
        lines.append(
            f"  {size:>10d} {c['count'][i]:>11d}  {parts[0]}  {parts[1]}  {_f(c['p50_us'][i], 9)} "
            f"{_f(c['p99_us'][i], 9)} {slowest:>12} {_f(c['fraction'][i], 6, 3)}"
        )
    finite = [b for b in busbws if not math.isnan(b)]
    if finite:
        lines.append(f"# Avg bus bandwidth    : {sum(finite) / len(finite):.4f} GB/s; peak {max(finite):.4f} GB/s")
    return lines


def p2p_lines(t: Table) -> list[str]:
    c, a = t.cols, t.attrs
    ranks = a.get("ranks", [])
    lines = [
        "",
        f"# {t.op} on {a.get('label', t.path)} between ranks {list(ranks)}, window {a.get('window')}, "
        f"{a.get('warmup')} warm-up + {a.get('iters')} timed iterations",
        f"# fraction of: {a.get('fraction_of')}",
        f"# {'size':>10}  {'time(us)':>9} {'GB/s':>8} {'p50(us)':>9} {'p99(us)':>9} {'#wrong':>7} {'frac':>6}",
    ]
    for i in range(len(c["size"])):
        lines.append(
            f"  {c['size'][i]:>10d}  {_f(c['time_us'][i], 9)} {_f(c['algbw_gbps'][i], 8)} {_f(c['p50_us'][i], 9)} "
            f"{_f(c['p99_us'][i], 9)} {c['wrong'][i]:>7d} {_f(c['fraction'][i], 6, 3)}"
        )
    return lines


def matrix_lines(path: str, m: dict[str, Any]) -> list[str]:
    nodes = m["nodes"]
    w = max(8, *(len(n) for n in nodes)) + 1
    lines = [
        "",
        f"# node pairs on {m.get('label', path)}: bandwidth (GB/s) of {human_bytes(int(m['size']))} messages, "
        f"row sends to column; {m.get('rounds')} round(s); fraction of: {m.get('fraction_of')}",
        "# " + "from \\ to".ljust(w) + "".join(n.rjust(w) for n in nodes),
    ]
    for i, n in enumerate(nodes):
        lines.append("  " + n.ljust(w) + "".join(
            ("-".rjust(w) if i == j else _f(m["bandwidth_gbps"][i, j], w)) for j in range(len(nodes))))
    lines.append(f"# latency (us) of {int(m['latency_size'])}-byte ping-pong:")
    for i, n in enumerate(nodes):
        lines.append("  " + n.ljust(w) + "".join(
            ("-".rjust(w) if i == j else _f(m["latency_us"][i, j], w, 1)) for j in range(len(nodes))))
    return lines


def format_report(r: Result) -> str:
    lines = header(r)
    for t in r.tables:
        lines += p2p_lines(t) if t.op.startswith("p2p_") else collective_lines(t)
    for path, m in r.matrices.items():
        lines += matrix_lines(path, m)
    return "\n".join(lines) + "\n"


def _peak(t: Table) -> dict[int, float]:
    """Best busbw (algbw for p2p) per size over the modes."""
    col = "algbw_gbps" if t.op.startswith("p2p_") else "busbw_gbps"
    out: dict[int, float] = {}
    for s, v in zip(t.cols["size"].tolist(), t.cols[col].tolist(), strict=True):
        if not math.isnan(v):
            out[s] = max(out.get(s, -1.0), v)
    return out


def format_comparison(a: Result, b: Result) -> str:
    """Rows both files measured, side by side, with B/A; A is the first file."""
    lines = [
        f"# A: {a.file} ({a.attrs.get('site')}, job {a.attrs.get('job_id')}, {a.attrs.get('created')}, "
        f"nodes {', '.join(a.attrs.get('nodes') or [])})",
        f"# B: {b.file} ({b.attrs.get('site')}, job {b.attrs.get('job_id')}, {b.attrs.get('created')}, "
        f"nodes {', '.join(b.attrs.get('nodes') or [])})",
    ]
    shared = 0
    for ta in a.tables:
        tb = b.table(ta.op, ta.path)
        if tb is None:
            continue
        pa, pb = _peak(ta), _peak(tb)
        sizes = sorted(set(pa) & set(pb))
        if not sizes:
            continue
        shared += 1
        what = "GB/s" if ta.op.startswith("p2p_") else "busbw GB/s"
        lines += ["", f"# {ta.op} on {ta.path}: best {what} per size", f"# {'size':>10} {'A':>10} {'B':>10} {'B/A':>7}"]
        for s in sizes:
            ratio = pb[s] / pa[s] if pa[s] > 0 else float("nan")
            lines.append(f"  {s:>10d} {pa[s]:>10.3f} {pb[s]:>10.3f} {_f(ratio, 7, 3)}")
    for path, ma in a.matrices.items():
        mb = b.matrices.get(path)
        if mb is None:
            continue
        shared += 1
        lines += ["", f"# node pairs on {path}: bandwidth GB/s A -> B (B/A)"]
        for i, ni in enumerate(ma["nodes"]):
            for j, nj in enumerate(ma["nodes"]):
                if i == j or ni not in mb["nodes"] or nj not in mb["nodes"]:
                    continue
                va = ma["bandwidth_gbps"][i, j]
                vb = mb["bandwidth_gbps"][mb["nodes"].index(ni), mb["nodes"].index(nj)]
                change = _f(vb / va if va else float("nan"), 0, 3).strip()
                lines.append(f"  {ni}->{nj}: {va:.3f} -> {vb:.3f} ({change})")
    if not shared:
        lines.append("# the two files have no operation, path and size in common")
    return "\n".join(lines) + "\n"


def plot(r: Result, out_dir: str | Path, other: Result | None = None) -> list[Path]:
    """PNG files: busbw against size per operation and path, and a heat map per pair matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for t in r.tables:
        if t.op == "barrier":
            continue
        col = "algbw_gbps" if t.op.startswith("p2p_") else "busbw_gbps"
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for res, style, tag in ((r, "-", "A: " if other else ""), (other, "--", "B: ")):
            if res is None:
                continue
            tt = res.table(t.op, t.path)
            if tt is None:
                continue
            for mode, name in ((0, "out-of-place"), (1, "in-place")):
                sel = tt.cols["in_place"] == mode
                if sel.any():
                    ax.plot(tt.cols["size"][sel], tt.cols[col][sel], style, marker="o", ms=3,
                            label=f"{tag}{tt.attrs.get('label', tt.path)} {name}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bandwidth (GB/s)" if t.op.startswith("p2p_") else "bus bandwidth (GB/s)")
        ax.set_title(f"{t.op} on {t.attrs.get('label', t.path)} ({t.attrs.get('nranks')} ranks, {r.attrs.get('site')})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"busbw_{t.op}_{t.path}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    for name, m in r.matrices.items():
        nodes = m["nodes"]
        fig, ax = plt.subplots(figsize=(1.2 * len(nodes) + 3, 1.0 * len(nodes) + 2.5))
        im = ax.imshow(m["bandwidth_gbps"], cmap="viridis")
        ax.set_xticks(range(len(nodes)), nodes, rotation=45, ha="right")
        ax.set_yticks(range(len(nodes)), nodes)
        ax.set_xlabel("to node")
        ax.set_ylabel("from node")
        for i in range(len(nodes)):
            for j in range(len(nodes)):
                v = m["bandwidth_gbps"][i, j]
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(im, ax=ax, label="GB/s")
        ax.set_title(f"node pairs, {human_bytes(int(m['size']))} messages ({m.get('label', name)})")
        fig.tight_layout()
        path = out_dir / f"pairs_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


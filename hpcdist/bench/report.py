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

from hpcdist.bench.bandwidth import COLLECTIVES, P2P_TESTS, human_bytes
from hpcdist.console import table, text
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

    from hpcdist.store.checkpoint.tree import plain as _plain
    from hpcdist.store.results import read_facts, read_table

    file = Path(file)
    if not file.is_file():
        raise BenchmarkError(f"result file {str(file)!r} does not exist; `hpcdist submit` prints where a result lands")
    try:
        f = h5py.File(file, "r")
    except OSError as exc:
        raise BenchmarkError(f"{file} is not an HDF5 file ({exc})") from None
    with f:
        attrs = read_facts(f)
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
            if "rails" in g:  # one rail per local rank (absent in files written before rails were measured)
                out.matrices[path].update(
                    rails=[n.decode() if isinstance(n, bytes) else str(n) for n in g["rails"][()]],
                    rail_bandwidth_gbps=g["rail_bandwidth_gbps"][()], rail_latency_us=g["rail_latency_us"][()])
        if "interconnect" in f:
            out.interconnect = read_table(f["interconnect"])
    return out


def _f(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


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
    ]
    grid = table(
        "size", "count", "out-of-place\ntime(us)", "algbw", "busbw", "#wrong",
        "in-place\ntime(us)", "algbw", "busbw", "#wrong", "p50(us)", "p99(us)", "slowest", "frac", left=0,
    )
    busbws = []
    for size in sorted(set(c["size"].tolist())):
        rows = {int(ip): i for i, (s, ip) in enumerate(zip(c["size"], c["in_place"], strict=True)) if s == size}
        cells: list[str] = []
        for mode in (0, 1):
            i = rows.get(mode)
            if i is None:
                cells += [""] * 4
                continue
            busbws.append(c["busbw_gbps"][i])
            cells += [_f(c["time_us"][i]), _f(c["algbw_gbps"][i]), _f(c["busbw_gbps"][i]), str(c["wrong"][i])]
        i = rows.get(0, rows.get(1))
        assert i is not None
        grid.add_row(
            str(size), str(c["count"][i]), *cells, _f(c["p50_us"][i]), _f(c["p99_us"][i]),
            f"{c['slowest_rank'][i]}@{c['slowest_host'][i]}", _f(c["fraction"][i], 3),
        )
    lines += text(grid, indent=2).splitlines()
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
    ]
    grid = table("size", "time(us)", "GB/s", "p50(us)", "p99(us)", "#wrong", "frac", left=0)
    for i in range(len(c["size"])):
        grid.add_row(
            str(c["size"][i]), _f(c["time_us"][i]), _f(c["algbw_gbps"][i]), _f(c["p50_us"][i]),
            _f(c["p99_us"][i]), str(c["wrong"][i]), _f(c["fraction"][i], 3),
        )
    return lines + text(grid, indent=2).splitlines()


def _matrix(nodes: list[str], values: np.ndarray, digits: int, slow: np.ndarray | None = None) -> list[str]:
    """A node-by-node matrix, row sends to column; the diagonal is '-', a slow cell ends in ' SLOW'."""
    grid = table("from \\ to", *nodes)
    for i, n in enumerate(nodes):
        grid.add_row(n, *("-" if i == j else _f(values[i, j], digits) + (" SLOW" if slow is not None and slow[i, j]
                                                                           else "") for j in range(len(nodes))))
    return text(grid, indent=2).splitlines()


def slow_pairs(m: dict[str, Any]) -> np.ndarray:
    """Which cells of the bandwidth matrix fall below the site's minimum kept with it (none if unset)."""
    bw = np.asarray(m["bandwidth_gbps"], dtype=float)
    low = float(m.get("min_gbps", math.nan))
    slow = np.zeros(bw.shape, dtype=bool) if math.isnan(low) else ~(bw >= low)
    np.fill_diagonal(slow, False)
    return slow


def matrix_lines(path: str, m: dict[str, Any]) -> list[str]:
    nodes = m["nodes"]
    slow = slow_pairs(m)
    marked = [f"{nodes[i]}->{nodes[j]}" for i, j in zip(*np.nonzero(slow), strict=True)]
    note = (f"# SLOW: {', '.join(marked)} below the site's minimum {float(m['min_gbps']):g} GB/s"
            if marked else None)
    rails = m.get("rails", [])
    lines = [
        "",
        f"# node pairs on {m.get('label', path)}: bandwidth (GB/s) of {human_bytes(int(m['size']))} messages, "
        f"row sends to column; {m.get('rounds')} round(s); fraction of: {m.get('fraction_of')}"
        + (f"; each pair's slowest of {len(rails)} rails, measured at once" if len(rails) > 1 else ""),
        *_matrix(nodes, m["bandwidth_gbps"], 3, slow),
        *([note] if note else []),
        f"# latency (us) of {int(m['latency_size'])}-byte ping-pong:",
        *_matrix(nodes, m["latency_us"], 1),
    ]
    for r, name in enumerate(rails if len(rails) > 1 else []):
        one = {**m, "bandwidth_gbps": m["rail_bandwidth_gbps"][r]}
        lines += [f"# {name}: bandwidth (GB/s)", *_matrix(nodes, one["bandwidth_gbps"], 3, slow_pairs(one))]
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
        grid = table("size", "A", "B", "B/A", left=0)
        for s in sizes:
            grid.add_row(str(s), f"{pa[s]:.3f}", f"{pb[s]:.3f}", _f(pb[s] / pa[s] if pa[s] > 0 else None, 3))
        lines += ["", f"# {ta.op} on {ta.path}: best {what} per size", *text(grid, indent=2).splitlines()]
    for path, ma in a.matrices.items():
        mb = b.matrices.get(path)
        if mb is None:
            continue
        shared += 1
        grid = table("from", "to", "A", "B", "B/A", left=2)
        for i, ni in enumerate(ma["nodes"]):
            for j, nj in enumerate(ma["nodes"]):
                if i == j or ni not in mb["nodes"] or nj not in mb["nodes"]:
                    continue
                va = ma["bandwidth_gbps"][i, j]
                vb = mb["bandwidth_gbps"][mb["nodes"].index(ni), mb["nodes"].index(nj)]
                grid.add_row(ni, nj, f"{va:.3f}", f"{vb:.3f}", _f(vb / va if va else None, 3))
        lines += ["", f"# node pairs on {path}: bandwidth GB/s", *text(grid, indent=2).splitlines()]
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
        written.append(_save(fig, out_dir / f"busbw_{t.op}_{t.path}.png"))
    for name, m in r.matrices.items():
        nodes = m["nodes"]
        slow = slow_pairs(m)
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
                    ax.text(j, i, f"{v:.3g}" + ("\nSLOW" if slow[i, j] else ""), ha="center", va="center",
                            color="white", fontsize=8)
                if slow[i, j]:  # a slow pair: outlined in red
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=3))
        fig.colorbar(im, ax=ax, label="GB/s")
        ax.set_title(f"node pairs, {human_bytes(int(m['size']))} messages ({m.get('label', name)})")
        written.append(_save(fig, out_dir / f"pairs_{name}.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""The benchmark's result file, rewritten atomically after each measured size.

Layout (inside the ``hpcdist.result`` format, see ``hpcdist.store.results``; ``bench_layout`` 1):

- root attributes, besides the run's: ``complete`` (False
  until the sweep ends: a run that died leaves the rows measured so far), ``bench_layout``,
  ``rank_layout`` (JSON: rank, node, hostname, local_rank, node_index), ``paths`` (labels such
  as ``torch/gloo``, ``mpi/numpy``), ``params_json``, ``baselines_json``, ``verdict`` ("ok",
  "below minimum: ..." or "failed at ...");
- root datasets (``LIST_FACTS`` in ``hpcdist.store.results``), besides the run's ``/hosts``
  (each rank's hostname): ``/nodes`` (the scheduler's node names, in rank order) and
  ``/rank_nodes`` (node of each rank);
- ``/interconnect``: a table of InfiniBand ports per node (host, device, port, state,
  link_layer, rate, rate_gbps), empty where a node has none, with the site's ``network``
  figures as attributes;
- ``/bench/<op>/<path>`` (``path`` is ``torch`` or ``mpi``; ``op`` a collective or
  ``p2p_pingpong``, ``p2p_unidir``, ``p2p_bidir``): the table ``measure.ROW_COLUMNS``
  (``size`` bytes, ``count`` elements, ``in_place`` 0/1, ``time_us``, ``algbw_gbps``,
  ``busbw_gbps``, ``p50_us``, ``p99_us``, ``slowest_rank``, ``slowest_host``,
  ``slowest_time_us``, ``wrong``, ``fraction``), with attributes ``op``, ``path``, ``label``,
  ``dtype``, ``nranks``, ``bus_factor``, ``warmup``, ``iters``, ``fraction_of``;
- ``/pairs/<path>``: datasets ``nodes`` (n), ``bandwidth_gbps`` (n x n, row sends to column,
  NaN on the diagonal; each pair's slowest rail), ``latency_us`` (n x n, symmetric; the highest
  rail's), ``fraction`` (n x n), ``rails`` (``rail 0 (mlx5_0)``...: local rank r of each node, the
  site's r-th HCA), ``rail_bandwidth_gbps`` and ``rail_latency_us`` (rails x n x n), and the
  attributes ``size``, ``latency_size``, ``iters``, ``window``, ``rounds``, ``fraction_of``,
  ``rail_ranks`` (rails x n: the rank of each rail on each node).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcdist.bench.measure import ROW_COLUMNS
from hpcdist.store.results import result_file, write_table

BENCH_LAYOUT = 1


@dataclass
class Table:
    attrs: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Matrix:
    """A node-pair matrix; with rails, each figure is the pair's slowest rail's, and the rails'
    own are kept (``[rail, row, column]``)."""

    nodes: list[str]
    bandwidth: np.ndarray
    latency: np.ndarray
    fraction: np.ndarray
    attrs: dict[str, Any]
    rails: list[str] = field(default_factory=list)
    rail_bandwidth: np.ndarray | None = None
    rail_latency: np.ndarray | None = None


class BenchRecord:
    """Rank 0's copy of everything measured so far, and the file it is written to."""

    def __init__(self, path: Path, attrs: dict[str, Any], interconnect: list[dict[str, Any]], network: dict[str, Any]):
        self.path = path
        self.attrs = dict(attrs)
        self.attrs["bench_layout"] = BENCH_LAYOUT
        self.attrs.setdefault("verdict", "running")
        self.interconnect = interconnect
        self.network = network
        self.tables: dict[str, Table] = {}
        self.matrices: dict[str, Matrix] = {}
        self.tracking: Any = None  # the job's tracker run (hpcdist.track), when the job names one

    def table(self, name: str, **attrs: Any) -> Table:
        if name not in self.tables:
            self.tables[name] = Table(attrs)
        return self.tables[name]

    def add_row(self, name: str, row: dict[str, Any]) -> None:
        self.tables[name].rows.append(row)
        if self.tracking is not None:  # step: the row's number in the job (W&B takes only rising steps)
            figures = {f"{name}/{k}": row[k] for k in ("size", "busbw_gbps", "algbw_gbps", "time_us") if k in row}
            self.tracking.metrics(sum(len(t.rows) for t in self.tables.values()), figures)

    def flush(self, complete: bool, verdict: str | None = None) -> Path:
        """Write the whole file again (small: rows only, no buffers); readers see old or new, never half."""
        attrs = dict(self.attrs, complete=complete)
        if verdict is not None:
            self.attrs["verdict"] = attrs["verdict"] = verdict
        with result_file(self.path, attrs) as f:
            cols = ("host", "device", "port", "state", "link_layer", "rate", "rate_gbps")
            ib: dict[str, Any] = {c: [p[c] for p in self.interconnect] for c in cols}
            ib["port"] = np.asarray(ib["port"], dtype=np.int32)
            ib["rate_gbps"] = np.asarray(ib["rate_gbps"], dtype=np.float64)
            for c in ("host", "device", "state", "link_layer", "rate"):
                ib[c] = [str(v) for v in ib[c]] if ib[c] else np.array([], dtype=object)
            g = write_table(f, "interconnect", ib)
            for key, value in self.network.items():
                g.attrs[key] = "" if value is None else value
            for name, table in self.tables.items():
                columns: dict[str, Any] = {}
                for col in ROW_COLUMNS:
                    values = [r[col] for r in table.rows]
                    if col == "slowest_host":
                        columns[col] = [str(v) for v in values]
                    else:
                        columns[col] = np.asarray(values, dtype=_dtype(col))
                write_table(f, name, columns, complete=complete, **table.attrs)
            for name, m in self.matrices.items():
                g = f.require_group(name)
                g.create_dataset("nodes", data=np.array(m.nodes, dtype=object), dtype=_str_dtype())
                g.create_dataset("bandwidth_gbps", data=m.bandwidth)
                g.create_dataset("latency_us", data=m.latency)
                g.create_dataset("fraction", data=m.fraction)
                if m.rail_bandwidth is not None and m.rail_latency is not None:
                    g.create_dataset("rails", data=np.array(m.rails, dtype=object), dtype=_str_dtype())
                    g.create_dataset("rail_bandwidth_gbps", data=m.rail_bandwidth)
                    g.create_dataset("rail_latency_us", data=m.rail_latency)
                for key, value in m.attrs.items():
                    g.attrs[key] = value
        return self.path


def _dtype(col: str) -> Any:
    if col in ("size", "count", "wrong"):
        return np.int64
    if col in ("in_place", "slowest_rank"):
        return np.int32
    return np.float64


def _str_dtype() -> Any:
    import h5py

    return h5py.string_dtype()


def rank_layout(node_of_rank: tuple[str, ...], hostnames: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """The distinct nodes in rank order, and a JSON list of
    ``{rank, node (scheduler's name), hostname, local_rank, node_index}``."""
    nodes: list[str] = []
    layout = []
    seen: dict[str, int] = {}
    for rank, node in enumerate(node_of_rank):
        if node not in seen:
            seen[node] = 0
            nodes.append(node)
        layout.append({
            "rank": rank, "node": node, "hostname": hostnames[rank] if rank < len(hostnames) else node,
            "local_rank": seen[node], "node_index": nodes.index(node),
        })
        seen[node] += 1
    return nodes, json.dumps(layout)

"""Result files: versioned HDF5 with the run's facts as attributes, committed atomically. Both
sides: rank 0 writes them on the nodes; the login side reads them (`hpcdist report`, `--compare`).

Layout (format ``hpcdist.result`` version 2), readable by ``h5dump`` as well as by hpcdist:

- root attributes: ``format``, ``format_version``, ``kind``, ``job_name``, ``job_id``, ``site``,
  ``world_size``, ``num_nodes``, ``created`` (UTC ISO 8601),
  ``complete`` (False while a run that died left partial rows), ``spec_json``, ``site_json``,
  ``version_*`` (hpcdist, python, torch, numpy, h5py, mpi, nccl); after a node failure
  ``excluded_nodes`` and ``node_failures`` (``hpcdist.store.records.node_failures``);
- root datasets of strings, one entry per rank or per node (``LIST_FACTS``): ``/hosts`` (each
  rank's host), and for benchmarks ``/nodes`` and ``/rank_nodes``. They are datasets, not
  attributes, because HDF5 keeps attributes in a 64 KiB object header: about 4,000 host names;
- ``/env``: attributes holding the NCCL_*, UCX_*, OMP_*, GLOO_* and SLURM_JOB_* variables
  (a value whose name looks secret, ``hpcdist.config.site.looks_secret``, is stored as
  ``REDACTED``);
- one group per table (``/bootstrap``, ``/bench/all_reduce/torch``...): one 1-D dataset per
  column, and a ``columns`` attribute giving their order;
- benchmark results (``bench_layout`` attribute, version 1) add ``/interconnect``,
  ``/bench/<op>/<path>`` tables and ``/pairs/<path>`` matrices: see ``hpcdist.bench.record``.

Attributes go through ``hpcdist.store.checkpoint.tree.attr_value`` and come back through ``plain``.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import platform
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist._version import __version__
from hpcdist.config.paths import node_failure_record
from hpcdist.config.site import REDACTED, looks_secret
from hpcdist.files.atomic import atomic_path
from hpcdist.store.checkpoint.tree import attr_value, host_value, plain
from hpcdist.store.records import node_failures

if TYPE_CHECKING:
    import h5py
    import numpy as np
    from rich.table import Table

FORMAT = "hpcdist.result"
FORMAT_VERSION = 2  # 2: per-rank and per-node lists are datasets (LIST_FACTS), not attributes
# Facts with one entry per rank or per node: root datasets, never attributes (see above).
LIST_FACTS = ("hosts", "nodes", "rank_nodes")
ENV_PREFIXES = ("NCCL_", "UCX_", "OMP_", "GLOO_", "SLURM_JOB_", "CUDA_VISIBLE_DEVICES", "TORCH_")


def versions() -> dict[str, str]:
    """Versions of what the numbers depend on; missing pieces are recorded as 'none'."""
    out = {"hpcdist": __version__, "python": platform.python_version()}
    for name in ("torch", "numpy", "h5py"):
        try:
            out[name] = str(__import__(name).__version__)
        except ImportError:
            out[name] = "none"
    out["nccl"] = "none"
    try:
        import torch

        if torch.cuda.is_available():
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - any failure means no usable NCCL
        pass
    out["mpi"] = "none"
    # Never import mpi4py.MPI here: the import initialises MPI, which under srun --mpi=pmix
    # blocks until every rank does the same.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        out["mpi"] = mpi.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    mpi4py = sys.modules.get("mpi4py")
    out["mpi4py"] = str(getattr(mpi4py, "__version__", "none"))
    return out


def run_attrs(
    *,
    kind: str,
    job_name: str,
    job_id: str | None,
    site: str,
    hosts: Sequence[str],
    num_nodes: int,
    spec_json: str,
    site_json: str,
) -> dict[str, Any]:
    """The root attributes every result file carries."""
    attrs: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "job_name": job_name,
        "job_id": job_id or "",
        "site": site,
        "world_size": len(hosts),
        "num_nodes": num_nodes,
        "hosts": list(hosts),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "complete": True,
        "spec_json": spec_json,
        "site_json": site_json,
    }
    attrs.update({f"version_{k}": v for k, v in versions().items()})
    return attrs


def captured_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the numbers depend on; a value whose name looks secret is never written."""
    env = os.environ if env is None else env
    return {k: REDACTED if looks_secret(k) else v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)}


@contextmanager
def result_file(path: Path, attrs: Mapping[str, Any]) -> Iterator[h5py.File]:
    """An HDF5 file open for writing that appears at `path` only once it is complete."""
    import h5py

    attrs = {**node_failures.attrs(node_failure_record(path)), **attrs}  # nodes the job ran again without
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            for key, value in attrs.items():
                if key in LIST_FACTS:
                    f.create_dataset(key, data=[str(v) for v in value], dtype=h5py.string_dtype())
                else:
                    f.attrs[key] = attr_value(value)
            env = f.create_group("env")
            for key, value in captured_env().items():
                env.attrs[key] = value
            yield f
            f.flush()


def write_table(
    parent: h5py.Group, name: str, columns: Mapping[str, Sequence[Any] | np.ndarray], **attrs: Any
) -> h5py.Group:
    """A table as a group of equal-length 1-D column datasets (h5dump shows each as an array)."""
    import h5py
    import numpy as np

    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(f"table {name!r}: columns of different lengths {sorted(lengths)}")
    group = parent.require_group(name)
    for col, values in columns.items():
        arr = np.asarray(host_value(values))
        if arr.dtype.kind in "OU":
            arr = np.asarray([str(v) for v in values], dtype=h5py.string_dtype())
        group.create_dataset(col, data=arr)
    group.attrs["columns"] = np.array(list(columns), dtype=h5py.string_dtype())
    for key, value in attrs.items():
        group.attrs[key] = attr_value(value)
    return group


def read_table(group: h5py.Group) -> dict[str, np.ndarray]:
    """A table written by `write_table`, columns in their written order."""
    import numpy as np

    names = [c.decode() if isinstance(c, bytes) else str(c) for c in group.attrs["columns"]]
    out = {}
    for name in names:
        data = group[name][()]
        if data.dtype.kind == "O":  # h5py gives UTF-8 bytes; astype(str) would decode as ASCII
            data = np.array([v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in data], dtype=str)
        out[name] = data
    return out


def read_facts(f: h5py.File) -> dict[str, Any]:
    """The run's facts: root attributes and the ``LIST_FACTS`` datasets, as plain values."""
    facts = {k: plain(v) for k, v in f.attrs.items()}
    for key in LIST_FACTS:
        if key in f:
            facts[key] = plain(f[key][()])
    return facts


def read_attrs(path: Path) -> dict[str, Any]:
    """The run's facts of a result file (``read_facts``), with JSON fields decoded; checks the format."""
    import h5py

    with h5py.File(path, "r") as f:
        attrs = read_facts(f)
    if attrs.get("format") != FORMAT:
        raise ValueError(f"{path} is not an hpcdist result file (format {attrs.get('format')!r})")
    for key, decoded in (("spec_json", "spec"), ("site_json", "site_config")):
        if key in attrs:
            attrs[decoded] = json.loads(attrs.pop(key))
    return attrs


def summarize(path: Path, rows: int = 8) -> str:
    """A plain-text view of any result file: the run's facts, then every table (evenly sampled rows)."""
    import h5py
    from rich import box
    from rich.table import Table

    attrs = read_attrs(path)
    lines = [
        f"{path}",
        f"  job {attrs.get('job_name')} ({attrs.get('kind')}), id {attrs.get('job_id')}, site {attrs.get('site')}, "
        f"{attrs.get('world_size')} ranks on {attrs.get('num_nodes')} node(s), created {attrs.get('created')}"
        + ("" if attrs.get("complete", True) else "  INCOMPLETE"),
    ]
    tables: list[tuple[str, h5py.Group]] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: tables.append((name, obj)) if "columns" in obj.attrs else None)
        for name, group in tables:
            table = read_table(group)
            n = len(next(iter(table.values()))) if table else 0
            picks = list(range(n)) if n <= rows else sorted({round(i * (n - 1) / (rows - 1)) for i in range(rows)})
            lines.append(f"\n  /{name}: {n} row(s)")
            shown = Table(box=box.SIMPLE, padding=(0, 1))
            for col in table:
                shown.add_column(col, justify="right", no_wrap=True)
            for i in picks:
                shown.add_row(*(_cell(v[i]) for v in table.values()))
            lines.append(_text(shown).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _text(table: Table) -> str:
    """`table` as plain text, as wide as it needs (no terminal, no colour)."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=10_000, color_system=None, force_terminal=False)
    console.print(table)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join("  " + line.rstrip() for line in out.splitlines() if line.strip())


def _cell(value: Any) -> str:
    if isinstance(value, float) or getattr(value, "dtype", None) is not None and value.dtype.kind == "f":
        return f"{float(value):.4g}"
    return str(value)

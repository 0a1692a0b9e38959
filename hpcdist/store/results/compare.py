"""``hpcdist report A.h5 --compare B.h5 C.h5``: training, inference (any non-benchmark) results side by side.

One column per result file; rows are the job parameters that differ between them (what a sweep
varied), then the kind's headline figures (training: loss, validation loss, tokens/s; inference:
tokens/s and latencies). Benchmarks have their own comparison (``hpcdist.bench.report``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcdist.console import table, text
from hpcdist.store.results import read_attrs

Figure = tuple[str, Callable[[dict[str, Any]], Any]]


def _attr(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r["attrs"].get(name)


def _summary(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r["summary"].get(name)


# The figures worth comparing, per kind (a kind not listed shows its scalar root attributes).
FIGURES: dict[str, list[Figure]] = {
    "train_gpt": [
        ("steps done", lambda r: f"{r['attrs'].get('final_step')}/{r['attrs'].get('steps')}"),
        ("final loss", _attr("final_loss")), ("final val loss", _attr("final_val_loss")),
        ("tokens/s (median)", _attr("tokens_per_s_median")), ("precision", _attr("precision")),
        ("requeues", _attr("requeues")), ("complete", _attr("complete")),
    ],
    "infer_gpt": [
        ("tokens/s", _summary("tokens_per_s")), ("new tokens", _summary("new_tokens")),
        ("wall s", _summary("wall_s")), ("first token p50 s", _summary("ttft_p50_s")),
        ("per token p50 s", _summary("per_token_p50_s")), ("total p99 s", _summary("total_p99_s")),
    ],
    "broadcast": [("busbw GB/s (median)", _attr("busbw_median_gbps"))],
}
_RUN_ATTRS = {"format", "format_version", "kind", "job_name", "job_id", "site", "world_size", "num_nodes", "hosts",
              "created", "spec", "site_config"}


def _load(path: Path) -> dict[str, Any]:
    import h5py

    attrs = read_attrs(path)
    with h5py.File(path, "r") as f:
        summary = {k: v for k, v in f["summary"].attrs.items()} if "summary" in f else {}
    return {"path": path, "attrs": attrs, "summary": summary}


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) or hasattr(value, "dtype") and getattr(value.dtype, "kind", "") == "f":
        return "-" if math.isnan(float(value)) else f"{float(value):.4g}"
    return str(value)


def format_results(paths: Sequence[str | Path]) -> str:
    """The results in `paths` (one kind) side by side: what differs in their specs, then their figures."""
    results = [_load(Path(p)) for p in paths]
    kinds = {r["attrs"].get("kind") for r in results}
    if len(kinds) != 1:
        raise ValueError(f"--compare takes results of one kind; these are {', '.join(sorted(map(str, kinds)))}")
    kind = str(kinds.pop())
    grid = table("", *(str(r["attrs"].get("job_id")) for r in results), left=1)
    grid.add_row("job", *(str(r["attrs"].get("job_name")) for r in results))
    specs = [_flat(r["attrs"].get("spec", {}).get("params", {}), "params") for r in results]
    for key in sorted({k for s in specs for k in s}):
        values = [s.get(key) for s in specs]
        if any(v != values[0] for v in values):
            grid.add_row(key, *map(_cell, values))
    figures = FIGURES.get(kind) or [
        (name, _attr(name)) for name in sorted({k for r in results for k, v in r["attrs"].items()
                                                if k not in _RUN_ATTRS and not k.startswith("version_")
                                                and isinstance(v, (int, float, str, bool))})]
    for label, get in figures:
        grid.add_row(label, *(_cell(get(r)) for r in results))
    head = [f"# {i + 1}: {r['path']}" for i, r in enumerate(results)]
    return "\n".join([*head, "", text(grid, indent=2).rstrip("\n")]) + "\n"

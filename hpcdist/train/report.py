"""``hpcdist report`` for training results: the figures a user checks, and the loss curves as a PNG.

A ``train_gpt`` result (``hpcdist.train.result``) holds every step's loss in ``/train/steps``
and every validation in ``/train/val``; this module reads them back. matplotlib (Agg backend)
is imported only when a plot is asked for.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hpcdist.console import table, text
from hpcdist.store.results import read_attrs, read_table


def _tables(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """The ``/train`` tables of a result file, by name (``steps``, ``val``, ``epochs``, ``checkpoints``)."""
    import h5py

    with h5py.File(path, "r") as f:
        group = f.get("train")
        if group is None:
            raise ValueError(f"{path} has no /train group: it is not a training result")
        return {name: read_table(group[name]) for name in group if "columns" in group[name].attrs}


def _f(x: Any, fmt: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(float(x), fmt)


def render_train_report(path: str | Path) -> str:
    """A readable summary of a ``train_gpt`` result: run, model, losses, tokens/s, checkpoints."""
    path = Path(path)
    a = read_attrs(path)
    t = _tables(path)
    site = a.get("site")
    site_name = site.get("name") if isinstance(site, dict) else site
    lines = [
        f"{path}",
        f"  job {a.get('job_name')} ({a.get('kind')}), id {a.get('job_id')}, site {site_name}, "
        f"{a.get('world_size')} ranks on {a.get('num_nodes')} node(s), created {a.get('created')}"
        + ("" if a.get("complete", True) else "  INCOMPLETE"),
    ]
    cfg = json.loads(a.get("model_config_json", "{}"))
    lines.append(
        f"  model: {int(a.get('num_params', 0)):,} parameters ({cfg.get('n_layer')} layers, d_model "
        f"{cfg.get('d_model')}, {cfg.get('n_head')} heads, context {cfg.get('context')}); precision "
        f"{a.get('precision')} (asked {a.get('precision_requested')})"
    )
    steps = t.get("steps", {})
    tokens_seen = int(steps["tokens_seen"][-1]) if len(steps.get("tokens_seen", ())) else 0
    seconds = float(np.sum(steps["step_time_s"])) if len(steps.get("step_time_s", ())) else 0.0
    lines.append(
        f"  steps {a.get('final_step')} of {a.get('steps')}, {tokens_seen:,} tokens in {seconds:.1f} s of steps; "
        f"requeues {a.get('requeues', 0)}, timeouts {a.get('timeouts', 0)}"
    )
    mfu = f", MFU {100 * float(a['mfu']):.1f}%" if "mfu" in a else ""
    lines.append(f"  tokens/s: {_f(a.get('tokens_per_s_median'), ',.0f')} (median over steps){mfu}")
    final, final_val = a.get("final_loss"), a.get("final_val_loss")
    ppl = _f(math.exp(min(float(final_val), 50.0)), ".2f") if final_val is not None else "-"
    lines.append(f"  loss: final {_f(final)}, validation {_f(final_val)} (perplexity {ppl})")
    val = t.get("val", {})
    if len(val.get("step", ())):
        grid = table("step", "val loss", "ppl", "train loss", left=0)
        by_step = dict(zip(steps.get("step", []), steps.get("loss", []), strict=True))
        for s, loss, p in zip(val["step"], val["loss"], val["ppl"], strict=True):
            grid.add_row(str(int(s)), _f(loss), _f(p, ".2f"), _f(by_step.get(s)))
        lines.append("  validation:")
        lines += text(grid, indent=4).splitlines()
    ck = t.get("checkpoints", {})
    if len(ck.get("step", ())):
        grid = table("step", "op", "MB", "seconds", "MB/s", "job", left=0)
        for i in range(len(ck["step"])):
            grid.add_row(
                str(int(ck["step"][i])), str(ck["op"][i]), _f(ck["bytes"][i] / 1e6, ".2f"), _f(ck["seconds"][i], ".3f"),
                _f(ck["mb_per_s"][i], ".1f"), str(ck["job_id"][i]),
            )
        written = int(np.sum(ck["op"] == "write"))
        lines.append(f"  checkpoints: {written} written, latest {a.get('checkpoint') or '-'}")
        lines += text(grid, indent=4).splitlines()
    else:
        lines.append("  checkpoints: none written")
    return "\n".join(lines) + "\n"


def plot_train(path: str | Path, out_dir: str | Path) -> list[Path]:
    """One PNG: training loss per step and validation loss against step, named after the result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path, out_dir = Path(path), Path(out_dir)
    a = read_attrs(path)
    t = _tables(path)
    steps, val = t.get("steps", {}), t.get("val", {})
    if not len(steps.get("step", ())):
        raise ValueError(f"{path} has no training steps to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(steps["step"], steps["loss"], lw=0.8, alpha=0.5, label="training loss")
    window = max(1, len(steps["loss"]) // 50)
    if window > 1:  # a running mean, so the trend reads through the per-batch noise
        smooth = np.convolve(steps["loss"], np.ones(window) / window, mode="valid")
        ax.plot(steps["step"][window - 1:], smooth, lw=1.5, label=f"training loss (mean of {window})")
    if len(val.get("step", ())):
        ax.plot(val["step"], val["loss"], "o-", ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(f"{a.get('job_name')} (job {a.get('job_id')}, {a.get('world_size')} ranks)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = out_dir / f"{a.get('job_name')}_{path.stem}_loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [out]

"""Training metrics: rows per step, validation and checkpoint I/O; per-rank log files.

The tables travel inside every checkpoint (``/metrics``) so a run that was preempted and
requeued still ends with one result file covering all its steps. Rank 0 writes them to the
HDF5 result under ``/train`` in the ``hpcdist.store.results`` table layout.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcdist.store.checkpoint.tree import plain

STEP_COLUMNS = ("step", "epoch", "loss", "ppl", "grad_norm", "lr", "tokens_per_s", "step_time_s", "tokens_seen")
VAL_COLUMNS = ("step", "loss", "ppl")
CKPT_COLUMNS = ("step", "op", "bytes", "seconds", "mb_per_s", "job_id")
TABLES = {"steps": STEP_COLUMNS, "val": VAL_COLUMNS, "checkpoints": CKPT_COLUMNS}

# Dense (no sparsity) peak TFLOP/s per GPU, for model FLOPs utilisation when not given: by the exact
# name torch.cuda.get_device_name gives (a substring would rate an H100 PCIe or NVL as the SXM part,
# an A10G as an A10), per precision. fp32 is the plain FP32 rate, tf32 the tensor cores' rate for
# float32 matmuls when torch is asked for them (``rated_precision``; train_gpt asks on CUDA, as
# ``hpcdist.train.speed.fast_matmuls`` says), both dense (the data sheets' TF32 figure is with
# sparsity: half of it). NVIDIA data sheets: H100/H200 (SXM, PCIe, NVL), A100 (40/80 GB), L40S, A10.
_H100_SXM = {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 67.0}
_NVL = {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "NVIDIA H100 NVL": _NVL,
    "NVIDIA H200": _H100_SXM,
    "NVIDIA H200 NVL": _NVL,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
}


def rated_precision(precision: str, matmul_precision: str) -> str:
    """The precision a run's peak is read at: an fp32 run whose float32 matmuls use TF32
    (``torch.get_float32_matmul_precision()`` other than ``highest``) at the TF32 rate, so that its
    MFU is not rated against the plain FP32 peak it no longer runs at."""
    return "tf32" if precision == "fp32" and matmul_precision != "highest" else precision


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of the GPU named `device_name` at `precision` (bf16, fp16, fp32); None when
    the name is not in the table (no MFU then, rather than another part's peak)."""
    return PEAK_TFLOPS.get(device_name.strip(), {}).get(precision)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


@dataclass
class Metrics:
    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=lambda: {t: [] for t in TABLES})

    def add(self, table: str, **values: Any) -> None:
        self.rows[table].append(tuple(values[c] for c in TABLES[table]))

    def columns(self, table: str) -> dict[str, np.ndarray]:
        rows = self.rows[table]
        out = {}
        for i, col in enumerate(TABLES[table]):
            values = [r[i] for r in rows]
            out[col] = np.asarray(values, dtype=object if values and isinstance(values[0], str) else None)
            if out[col].dtype == object:
                out[col] = out[col].astype(str)
        return out

    def to_tree(self) -> dict[str, Any]:
        """The `/metrics` group of a checkpoint."""
        tree: dict[str, Any] = {}
        for table, cols in TABLES.items():
            data = self.columns(table)
            group: dict[str, Any] = {"columns_json": json.dumps(list(cols))}
            for col, arr in data.items():
                group[col] = arr.astype("S") if arr.dtype.kind == "U" else (arr if arr.size else np.zeros(0))
            tree[table] = group
        return tree

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> Metrics:
        m = cls()
        for table, cols in TABLES.items():
            group = tree.get(table, {})
            if not group:
                continue
            arrays = [np.asarray(group[c]) for c in cols]
            for values in zip(*arrays, strict=True):
                m.rows[table].append(tuple(plain(v) for v in values))
        return m

    def epochs(self) -> dict[str, np.ndarray]:
        """Per-epoch summary of the step rows."""
        steps = self.columns("steps")
        names = ("epoch", "steps", "mean_loss", "ppl", "tokens", "seconds", "tokens_per_s")
        out: dict[str, list[float]] = {k: [] for k in names}
        if not self.rows["steps"]:
            return {k: np.zeros(0) for k in out}
        tokens_per_step = np.diff(np.concatenate([[0], steps["tokens_seen"]]))
        for epoch in np.unique(steps["epoch"]):
            sel = steps["epoch"] == epoch
            seconds = float(steps["step_time_s"][sel].sum())
            tokens = float(tokens_per_step[sel].sum())
            mean = float(steps["loss"][sel].mean())
            for key, value in (
                ("epoch", int(epoch)), ("steps", int(sel.sum())), ("mean_loss", mean), ("ppl", perplexity(mean)),
                ("tokens", tokens), ("seconds", seconds), ("tokens_per_s", tokens / seconds if seconds else math.nan),
            ):
                out[key].append(value)
        return {k: np.asarray(v) for k, v in out.items()}


def add_rank_log_file(path: Path) -> logging.Handler:
    """Also log this rank's `hpcdist` records to `path`, in the same rank-tagged format."""
    logger = logging.getLogger("hpcdist")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a")
    fmt = logger.handlers[0].formatter if logger.handlers else logging.Formatter("%(asctime)s %(message)s")
    handler.setFormatter(fmt)
    logger.addHandler(handler)
    return handler

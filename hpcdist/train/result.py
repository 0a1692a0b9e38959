"""The training run's HDF5 result: the run's figures as root attributes, the metrics as tables.

Rank 0 fills the run's ``Context.results`` when the run ends (complete or not); the context
writes them, with the run's attributes (``hpcdist.store.results``), when it closes: the tables
``/train/steps``, ``/train/val``, ``/train/epochs`` and ``/train/checkpoints``.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from hpcdist.train.metrics import peak_tflops, rated_precision

if TYPE_CHECKING:
    from hpcdist.train.run import Run


def fill_result(r: Run, complete: bool) -> None:
    """The run's figures and metrics into ``r.api.results`` (rank 0)."""
    results = r.api.results
    attrs = results.attrs
    steps = r.metrics.columns("steps")
    val = r.metrics.columns("val")
    tok_s = [float(v) for v in steps["tokens_per_s"][1:]] or [float(v) for v in steps["tokens_per_s"]]
    median_tok_s = statistics.median(tok_s) if tok_s else float("nan")
    attrs.update(
        complete=complete,
        final_step=r.step,
        steps=r.params.steps,
        final_loss=float(steps["loss"][-1]) if len(steps["loss"]) else float("nan"),
        final_val_loss=float(val["loss"][-1]) if len(val["loss"]) else float("nan"),
        tokens_per_s_median=median_tok_s,
        num_params=r.cfg.num_params(),
        flops_per_token=r.cfg.flops_per_token(),
        model_config_json=r.cfg.model_dump_json(),
        params_json=r.params.model_dump_json(),
        precision=r.precision,
        precision_requested=r.params.precision,
        compiled=r.compile_cache is not None,
        requeues=r.requeues,
        timeouts=r.timeouts,
        checkpoint=str(r.last_checkpoint or ""),
    )
    mfu = _mfu(r, median_tok_s)
    if mfu is not None:
        attrs["mfu"] = mfu
        r.api.track(r.step, mfu=mfu)  # to the trackers too, at the last step (GPUs only: see _mfu)
    results.table("train/steps", steps)
    results.table("train/val", val)
    results.table("train/epochs", r.metrics.epochs())
    results.table("train/checkpoints", r.metrics.columns("checkpoints"))


def _mfu(r: Run, tokens_per_s: float) -> float | None:
    """Model FLOPs utilisation on GPUs: achieved training FLOP/s over the ranks' peak at the run's precision."""
    if r.ctx.device.type != "cuda":
        return None
    peak = r.params.peak_tflops
    if peak is None:
        rated = rated_precision(r.precision, torch.get_float32_matmul_precision())
        peak = peak_tflops(torch.cuda.get_device_name(r.ctx.device), rated)
    if peak is None:
        return None
    return r.cfg.flops_per_token() * tokens_per_s / (peak * 1e12 * r.ctx.world_size)

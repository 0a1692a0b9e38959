"""Inference result files, in the layout of ``hpcdist.store.results`` (format ``hpcdist.result`` v1).

``infer_gpt`` adds to the common root attributes ``checkpoint``, ``checkpoint_step``,
``model_config_json``, ``tokenizer`` (the checkpoint's, which encoded and decoded the text), ``tp``,
``dp``, ``load_method``, ``dtype`` (what the model and its KV cache ran in: ``bfloat16``...) and
``sampling_json`` (``end_token`` resolved to an id), and:

- ``/requests`` table, one row per prompt: ``request``, ``dp_group``, ``prompt`` (text),
  ``output`` (text, end token dropped, NUL written as ``\\x00``), ``prompt_tokens``, ``new_tokens``, ``finish``
  (``end``/``length``), ``ttft_s``, ``per_token_s``, ``total_s``, ``tokens_per_s``;
- ``/tokens``: ``prompt_ids`` and ``output_ids``, variable-length int32 rows in request order;
- ``/batches`` table: ``batch``, ``dp_group``, ``size``, ``first_request``,
  ``padded_prompt_tokens``, ``new_tokens``, ``prefill_s``, ``step_p50_s``, ``step_p99_s``,
  ``total_s``, ``tokens_per_s``;
- ``/ranks`` table: ``rank``, ``host``, ``tp_rank``, ``dp_group``, ``requests``, ``new_tokens``,
  ``load_s``, ``generate_s``, ``tokens_per_s``, ``weight_bytes`` (the rank's shard),
  ``load_resident_bytes`` (how much the rank's resident host memory grew across loading: on CPUs
  its shard), ``load_peak_bytes`` (the most it grew meanwhile, on the rank's GPU where it has
  one: its shard and one broadcast bucket, never the whole model), ``kv_cache_peak_bytes`` (its
  largest batch's cache), ``device_peak_bytes`` (CUDA's peak
  allocation on the rank's GPU; -1 on CPU);
- ``/load`` attributes: ``method`` and its figures (``bytes``, ``seconds``, ``algbw_gbps``...; ``broadcast``'s
  ``rounds``: the buckets rank 0 read and sent one after another);
- ``/summary`` attributes: ``ttft``, ``per_token``, ``step`` and ``total`` ``_p50_s``/``_p99_s``,
  ``new_tokens``, ``wall_s``, ``tokens_per_s`` (overall).

``broadcast``: root attributes ``bytes``, ``buckets``, ``tensors``, ``bucket_mb``,
``busbw_median_gbps``, and a ``/broadcast`` table per iteration: ``iter``, ``bytes``,
``time_s`` (mean over ranks), ``algbw_gbps``, ``busbw_gbps``, ``wrong``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.store.results import result_file, write_table

if TYPE_CHECKING:
    from hpcdist.data.tokenizer import Tokenizer
    from hpcdist.infer.broadcast import IterationFigures
    from hpcdist.infer.params import BroadcastParams, InferParams
    from hpcdist.model.checkpoint import CheckpointHeader


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Decoded text for the table; NUL (which HDF5 strings cannot hold) is written as the escape \\x00.
    The exact ids are in /tokens."""
    return tokenizer.decode(ids).replace("\x00", "\\x00")


def _columns(rows: Sequence[Mapping[str, Any]], skip: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    keys = [k for k in rows[0] if k not in skip] if rows else []
    return {k: [r[k] for r in rows] for k in keys}


def write_infer_result(
    path: Path,
    attrs: Mapping[str, Any],
    *,
    header: CheckpointHeader,
    params: InferParams,
    tp: int,
    dp: int,
    prompts: list[list[int]],
    requests: list[dict[str, Any]],
    batches: list[dict[str, Any]],
    ranks: list[dict[str, Any]],
    load: Mapping[str, Any],
    summary: Mapping[str, float],
    tokenizer: Tokenizer,
    end_token: int | None,
    dtype: str = "float32",
) -> Path:
    import h5py

    extra = {
        "checkpoint": str(header.path),
        "checkpoint_step": header.step,
        "model_config_json": header.config.model_dump_json(),
        "tp": tp,
        "dp": dp,
        "load_method": str(load["method"]),
        "dtype": dtype,
        "tokenizer": tokenizer.name,
        "sampling_json": json.dumps(
            {**{k: getattr(params, k) for k in ("max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                              "batch_size")}, "end_token": end_token}
        ),
    }
    with result_file(path, {**attrs, **extra}) as f:
        cols: dict[str, Any] = {
            "request": [r["request"] for r in requests],
            "dp_group": [r["dp_group"] for r in requests],
            "prompt": [_text(tokenizer, prompts[r["request"]]) for r in requests],
            "output": [_text(tokenizer, [t for t in r["output_ids"] if t != end_token]) for r in requests],
        }
        cols.update(_columns(requests, skip=("request", "dp_group", "output_ids")))
        write_table(f, "requests", cols)
        tokens = f.create_group("tokens")
        vlen = h5py.vlen_dtype(np.dtype("int32"))
        for name, seqs in (
            ("prompt_ids", [prompts[r["request"]] for r in requests]),
            ("output_ids", [r["output_ids"] for r in requests]),
        ):
            ds = tokens.create_dataset(name, (len(seqs),), dtype=vlen)
            for i, s in enumerate(seqs):
                ds[i] = np.asarray(s, dtype=np.int32)
        write_table(f, "batches", _columns(batches))
        write_table(f, "ranks", _columns(ranks))
        g = f.create_group("load")
        for k, v in load.items():
            g.attrs[k] = v
        g = f.create_group("summary")
        for k, v in summary.items():
            g.attrs[k] = v
    return path


def write_broadcast_result(
    path: Path,
    attrs: Mapping[str, Any],
    *,
    params: BroadcastParams,
    nbytes: int,
    buckets: int,
    tensors: int,
    figures: IterationFigures,
    wrongs: list[int],
) -> Path:
    extra = {
        "bytes": nbytes,
        "buckets": buckets,
        "tensors": tensors,
        "bucket_mb": params.bucket_mb,
        "busbw_median_gbps": figures.busbw_median_gbps,
    }
    with result_file(path, {**attrs, **extra}) as f:
        write_table(
            f,
            "broadcast",
            {
                "iter": list(range(len(figures.times))),
                "bytes": [nbytes] * len(figures.times),
                "time_s": figures.times,
                "algbw_gbps": figures.algbw_gbps,
                "busbw_gbps": figures.busbw_gbps,
                "wrong": wrongs,
            },
        )
    return path

"""The runners of ``infer_gpt`` and ``broadcast``, called on every rank with a JobRank.

``infer_gpt``: rank 0 resolves the checkpoint (a directory's ``latest``) to one file and every
rank uses that file, so a training job committing meanwhile cannot give ranks different steps;
every rank checks the spec against its header and prompts (same
answer everywhere, so a bad input fails all ranks at once, before any weight moves); ranks
form tensor-parallel groups of ``tp`` consecutive ranks (data-parallel across groups); weights
arrive by broadcast from rank 0 a bucket at a time (``broadcast_load``) or by per-rank shard
reads; each group generates for its share
of the prompts; rank 0 gathers everything and writes the result file.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from hpcdist.bench.bandwidth import algbw
from hpcdist.errors import BenchmarkError, CheckpointError, HpcdistError, JobError
from hpcdist.infer import metrics
from hpcdist.infer.broadcast import broadcast_state, describe, flat_buffer, in_buffer, iteration_figures
from hpcdist.infer.broadcast_load import load_streamed
from hpcdist.infer.generate import Sampling, generate
from hpcdist.infer.params import BroadcastParams, InferParams, inspect, locate_checkpoint, problems_text
from hpcdist.infer.shard_load import kv_layout, read_shard
from hpcdist.infer.tp import TPGPT, TPGroup, weight_bytes
from hpcdist.model.checkpoint import CheckpointHeader
from hpcdist.model.shapes import parameter_shapes as expected_shapes
from hpcdist.progress import report_progress
from hpcdist.runtime.plain import all_gather_plain, broadcast_plain
from hpcdist.store import checksum
from hpcdist.store.checkpoint.discovery import resolve
from hpcdist.store.hostmem import mark_memory, peak_memory, resident_bytes

if TYPE_CHECKING:
    from hpcdist.runtime.job_rank import JobRank


def tp_groups(ctx: JobRank, tp: int) -> TPGroup:
    """This rank's tensor-parallel group: ranks [g*tp, (g+1)*tp). Every rank creates every group."""
    tp_rank, mine = ctx.rank % tp, ctx.rank // tp
    if tp == 1:
        return TPGroup(0, 1, None)
    if tp == ctx.world_size:
        return TPGroup(tp_rank, tp, None)  # the default group
    group = None
    for g in range(ctx.world_size // tp):
        pg = dist.new_group(list(range(g * tp, (g + 1) * tp)), timeout=ctx.timeout)
        if g == mine:
            group = pg
    return TPGroup(tp_rank, tp, group)


def _agree(ctx: JobRank, local: Any) -> list[Any]:
    return all_gather_plain(local, what="its figures")


def agree_on_checkpoint(ctx: JobRank, params: InferParams) -> InferParams:
    """`params` with the checkpoint as the one file rank 0 resolved (a directory's ``latest``
    read once, on rank 0) and broadcast; rank 0's error, if any, fails every rank alike."""
    found: list[Any] = [None, None]  # the file, or rank 0's error
    if ctx.is_main:
        try:
            found[0] = str(resolve(locate_checkpoint(params.checkpoint, ctx.site)))
        except HpcdistError as exc:
            found[1] = str(exc)
    found = broadcast_plain(found, src=0, device=ctx.device if ctx.device.type == "cuda" else None,
                            what="the checkpoint it resolved")
    if found[1] is not None:
        raise JobError(f"infer_gpt cannot start: {problems_text([('params.checkpoint', params.checkpoint, found[1])])}")
    return params.model_copy(update={"checkpoint": found[0]})


def load_shards(
    ctx: JobRank, header: CheckpointHeader, tp: TPGroup
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Each rank reads its own shard; checksums verified as `read_shard` explains; ranks agree."""
    dist.barrier()
    t0 = time.perf_counter()
    read = read_shard(header, tp.rank, tp.size, ctx.rank, ctx.world_size)
    seconds = time.perf_counter() - t0
    everyone = _agree(ctx, (read.bad, read.bytes_read, seconds, len(read.verified)))
    bad = sorted({k for b, _, _, _ in everyone for k in b})
    if bad:
        raise CheckpointError(
            f"checkpoint {header.path}: tensors {bad[:3]} do not match their checksums; the file is corrupt"
        )
    total = sum(e[1] for e in everyone)
    slowest = max(e[2] for e in everyone)
    figures = {
        "method": "shard",
        "bytes": total,
        "rank_bytes": read.bytes_read,
        "seconds": slowest,
        "algbw_gbps": algbw(total, slowest),
        "verified_here": len(read.verified),
        "wrong": 0,
    }
    return read.state, figures


def model_dtype(header: CheckpointHeader, params: InferParams) -> torch.dtype:
    """The dtype generation runs in: the job's `params.dtype`, else the checkpoint's (its embedding's:
    a bfloat16 checkpoint is never upcast, which would double every rank's weights and KV cache)."""
    name = params.dtype or header.dtypes.get("transformer.wte.weight") or "float32"
    return cast(torch.dtype, getattr(torch, name))


def run_infer(ctx: JobRank, params: InferParams) -> dict[str, Any]:
    params = agree_on_checkpoint(ctx, params)
    header, prompts, problems, tokenizer, end_token = inspect(params, ctx.site, ctx.world_size)
    if problems or header is None or prompts is None:
        raise JobError(f"infer_gpt cannot start: {problems_text(problems)}")
    cfg = header.config
    tp = tp_groups(ctx, params.tp)
    dp, dp_rank = ctx.world_size // params.tp, ctx.rank // params.tp

    dtype = model_dtype(header, params)
    t_load = time.perf_counter()
    resident = resident_bytes()
    mark = mark_memory(ctx.device)
    model = TPGPT(cfg, tp, device=ctx.device, dtype=dtype)
    if params.load == "broadcast":  # a bucket at a time: no rank holds the whole model
        load = load_streamed(header, model, ctx.device, int(params.bucket_mb * (1 << 20)), params.verify_received)
    else:
        shard, load = load_shards(ctx, header, tp)
        model.load_shard(shard)
        del shard
    load_peak = peak_memory(ctx.device) - mark
    if ctx.rank == 0:
        ctx.log.info("%s", kv_layout(cfg, tp.size))
    weights = weight_bytes(model)
    resident = resident_bytes() - resident  # on CPUs the weights it kept: its shard, not the whole model
    load_s = time.perf_counter() - t_load
    ctx.log.info("weights loaded by %s in %.3f s (%s bytes) from %s", load["method"], load_s, load["bytes"],
                 header.path)

    sampling = Sampling(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        end_token=end_token,
    )
    mine = [i for i in range(len(prompts)) if i % dp == dp_rank]
    requests: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    steps: list[float] = []
    kv_peak = 0
    dist.barrier()
    t_gen = time.perf_counter()
    for start in range(0, len(mine), params.batch_size):
        ids = mine[start : start + params.batch_size]
        gen = torch.Generator(device=ctx.device).manual_seed(params.seed * 1_000_003 + ids[0])
        out = generate(model, [prompts[i] for i in ids], sampling, gen)
        new = sum(len(t) for t in out.tokens)
        kv_peak = max(kv_peak, out.cache_bytes)
        batches.append(
            {
                "batch": ids[0] // params.batch_size if dp == 1 else len(batches),
                "dp_group": dp_rank,
                "size": len(ids),
                "first_request": ids[0],
                "padded_prompt_tokens": max(len(prompts[i]) for i in ids),
                "new_tokens": new,
                "prefill_s": out.prefill_s,
                "step_p50_s": metrics.percentile(out.step_s, 50),
                "step_p99_s": metrics.percentile(out.step_s, 99),
                "total_s": out.elapsed_s,
                "tokens_per_s": new / out.elapsed_s if out.elapsed_s > 0 else float("nan"),
            }
        )
        steps.extend(out.step_s)
        for j, i in enumerate(ids):
            n = len(out.tokens[j])
            requests.append(
                {
                    "request": i,
                    "dp_group": dp_rank,
                    "prompt_tokens": len(prompts[i]),
                    "new_tokens": n,
                    "finish": out.finish[j],
                    "ttft_s": out.ttft_s[j],
                    "total_s": out.total_s[j],
                    "per_token_s": metrics.per_token_s(out.ttft_s[j], out.total_s[j], n),
                    "tokens_per_s": n / out.total_s[j] if out.total_s[j] > 0 else float("nan"),
                    "output_ids": out.tokens[j],
                }
            )
        report_progress("generate", len(requests), len(mine), unit="request")  # rank 0's share, for `hpcdist wait`
    gen_s = time.perf_counter() - t_gen
    my_tokens = sum(r["new_tokens"] for r in requests)
    rank_row = {
        "rank": ctx.rank,
        "host": ctx.info.hostname,
        "tp_rank": tp.rank,
        "dp_group": dp_rank,
        "requests": len(requests),
        "new_tokens": my_tokens,
        "load_s": load_s,
        "generate_s": gen_s,
        "tokens_per_s": my_tokens / gen_s if gen_s > 0 else float("nan"),
        "weight_bytes": weights,  # this rank's shard, in the model's dtype
        "load_resident_bytes": resident,  # host memory the load left this rank holding
        "load_peak_bytes": load_peak,  # the most it held meanwhile, beyond what it held before (GPU memory on GPUs)
        "kv_cache_peak_bytes": kv_peak,  # the largest batch's cache
        "device_peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else -1,
    }
    lead = tp.rank == 0  # one rank per group reports its requests (its peers hold the same)
    everyone = _agree(ctx, (rank_row, requests if lead else [], batches if lead else [], steps if lead else []))
    summary = {"rank": ctx.rank, "new_tokens": my_tokens, "tokens_per_s": rank_row["tokens_per_s"]}
    if not ctx.is_main:
        return summary
    all_requests = sorted((r for e in everyone for r in e[1]), key=lambda r: r["request"])
    all_batches = [b for e in everyone for b in e[2]]
    all_steps = [s for e in everyone for s in e[3]]
    ranks = [e[0] for e in everyone]
    wall = max(r["generate_s"] for r in ranks)
    total_new = sum(r["new_tokens"] for r in all_requests)
    figures = metrics.summarize(
        [r["ttft_s"] for r in all_requests],
        [r["total_s"] for r in all_requests],
        [r["per_token_s"] for r in all_requests],
        all_steps,
        total_new,
        wall,
    )
    from hpcdist.infer.results import write_infer_result

    path = write_infer_result(
        ctx.result_path(),
        ctx.run_attrs(),
        header=header,
        params=params,
        tp=params.tp,
        dp=dp,
        prompts=prompts,
        requests=all_requests,
        batches=all_batches,
        ranks=ranks,
        load=load,
        summary=figures,
        tokenizer=tokenizer,
        end_token=end_token,
        dtype=str(dtype).removeprefix("torch."),
    )
    from hpcdist import track

    track.report(ctx, figures, path)  # latency percentiles and throughput, to the trackers the job names
    first = tokenizer.decode(all_requests[0]["output_ids"])
    summary.update(
        {
            "result": str(path),
            "checkpoint": str(header.path),
            "tp": params.tp,
            "dp": dp,
            "load": {k: load[k] for k in ("method", "bytes", "seconds", "algbw_gbps")},
            "requests": len(all_requests),
            "tokens_per_s_overall": round(figures["tokens_per_s"], 2),
            "ttft_p50_ms": round(1e3 * figures["ttft_p50_s"], 3),
            "per_token_p50_ms": round(1e3 * figures["per_token_p50_s"], 3),
            "total_p50_ms": round(1e3 * figures["total_p50_s"], 3),
            "total_p99_ms": round(1e3 * figures["total_p99_s"], 3),
            "sample": (tokenizer.decode(prompts[0]) + first)[:120],
        }
    )
    return summary


def broadcast_source(params: BroadcastParams, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors `params` describes, filled with seeded random values (rank 0 only)."""
    gen = torch.Generator().manual_seed(0)
    if params.model is not None:
        shapes = expected_shapes(params.model)
    else:
        assert params.size_mb is not None
        total = int(params.size_mb * (1 << 20)) // 4
        per = max(1, int(params.tensor_mb * (1 << 20)) // 4)
        shapes = {f"t{i}": (min(per, total - i * per),) for i in range(-(-total // per))}
    return {k: torch.randn(s, generator=gen).to(device) for k, s in shapes.items()}


def run_broadcast(ctx: JobRank, params: BroadcastParams) -> dict[str, Any]:
    """Broadcast the same state `warmup + iters` times; every rank checks what it received."""
    bucket = int(params.bucket_mb * (1 << 20))
    src_state = broadcast_source(params, ctx.device) if ctx.is_main else None
    box: list[Any] = [
        (describe(src_state), [checksum.digest(v.cpu().numpy()) for v in src_state.values()]) if src_state else None
    ]
    box = broadcast_plain(box, src=0, device=ctx.device if ctx.device.type == "cuda" else None,
                          what="the state's layout and digests")
    meta, digests = box[0]
    buffer = flat_buffer(meta, ctx.device)  # allocated once, like the single-buffer figure it is compared with
    if src_state is not None:  # rank 0's tensors become views of it: nothing to pack per iteration
        src_state = in_buffer(src_state, meta, buffer)
    rows = []
    for it in range(params.warmup + params.iters):
        dist.barrier()
        got, stats = broadcast_state(src_state, ctx.device, bucket_bytes=bucket, meta=meta, buffer=buffer)
        wrong = sum(not checksum.matches(got[name].cpu().numpy(), d)
                    for (name, _, _), d in zip(meta, digests, strict=True))
        if it >= params.warmup:
            rows.append((stats, wrong))
        del got
    everyone = _agree(ctx, [(s.seconds, w) for s, w in rows])
    summary: dict[str, Any] = {"rank": ctx.rank, "wrong": sum(w for _, w in rows)}
    nbytes, buckets = rows[0][0].bytes, rows[0][0].buckets
    figures = iteration_figures(nbytes, [[s for s, _ in mine] for mine in everyone])
    wrongs = [sum(everyone[r][i][1] for r in range(ctx.world_size)) for i in range(params.iters)]
    median = figures.busbw_median_gbps
    if ctx.is_main:
        from hpcdist.infer.results import write_broadcast_result

        path = write_broadcast_result(
            ctx.result_path(), ctx.run_attrs(), params=params, nbytes=nbytes, buckets=buckets,
            tensors=len(meta), figures=figures, wrongs=wrongs,
        )
        summary.update({"result": str(path), "bytes": nbytes, "buckets": buckets, "tensors": len(meta),
                        "time_mean_s": float(np.mean(figures.times)), "busbw_median_gbps": round(median, 4),
                        "wrong_total": sum(wrongs)})
    if sum(wrongs):
        raise JobError(f"broadcast delivered wrong data: {sum(wrongs)} tensor copies differ from rank 0's")
    if params.min_busbw_gbps is not None and median < params.min_busbw_gbps:
        raise BenchmarkError(
            f"broadcast busbw median {median:.3f} GB/s is below params.min_busbw_gbps={params.min_busbw_gbps}"
        )
    return summary


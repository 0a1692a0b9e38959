"""The GPU check's verdicts (benchmarks/gpu_check.py): each row's ``judge_*`` turns what its job
wrote (result attributes and tables, checkpoints, log lines) into a Row, as a pure function, so
each is tested on CPU with one passing input and one for each way its subject can break
(tests/test_gpu_check.py). The training rows' judges are benchmarks/gpu_train_judges.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_jobs import failed_line, nccl_report, torch_nccl_settings

# ProcessGroupNCCL's error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING), as torch names the modes;
# 1 and 3 end the rank whose collective timed out, which hpcdist's abort path (summary, then NCCL's
# end) is written for; 0 and 2 leave it running until hpcdist ends it GRACE_S later.
ERROR_HANDLING = {0: "NoHandling", 1: "TearDown", 2: "CleanUpOnly", 3: "SkipCleanUp"}
ENDS_THE_RANK = (1, 3)
# the checks of benchmarks/gpu_ckpt_staging.py's report (its CHECKS; a test holds the two equal)
STAGING_CHECKS = ("model_tree_kept_on_device", "snapshot_pinned", "snapshot_equal", "buffers_reused",
                  "background_save_equal", "stager_pinned", "stager_equal")
ABORT_SUMMARY = "did not complete within {t} s; NCCL's watchdog ends this rank"


@dataclass
class Row:
    """One line of the table."""

    check: str
    status: str  # ok, skip, fail
    figure: str = ""
    detail: str = ""


def verdict(check: str, problems: Sequence[str], figure: str, detail: str) -> Row:
    """ok with `detail` when nothing is wrong, else fail naming every problem (then the detail)."""
    if problems:
        return Row(check, "fail", figure, "; ".join(problems) + (f" ({detail})" if detail else ""))
    return Row(check, "ok", figure, detail)


def finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s (flops per token x tokens/s) over the peak (TFLOP/s)."""
    if peak is None or not tokens_per_s > 0:
        return None
    return flops_per_token * tokens_per_s / (peak * 1e12)


# ------------------------------------------------------------------ the judgements (pure)


def judge_env(code: int, stdout: str, gpus: int) -> Row:
    """`hpcdist env` lists as many GPUs as torch counts."""
    listed = [ln.strip() for ln in stdout.splitlines() if ln.strip().startswith("gpu ")]
    problems = []
    if code != 0:
        problems.append(f"exit {code}")
    if len(listed) != gpus:
        problems.append(f"lists {len(listed)} GPU(s), torch counts {gpus}")
    return verdict("hpcdist env", problems, f"{len(listed)} GPU(s)", "; ".join(listed))


def judge_nccl(code: int, log: str, timeout_s: int, failure: str = "") -> Row:
    """The group a script's ``hpcdist.init()`` made on a job given a GPU, backend auto: NCCL, the
    spec's timeout, an error handling that ends a rank whose collective timed out (as torch logged
    it), and an all_reduce that sums."""
    check = "NCCL group (backend auto)"
    if code != 0:
        return Row(check, "fail", "", failure or f"exit {code}")
    report, torch_says = nccl_report(log), torch_nccl_settings(log)
    if report is None:
        return Row(check, "fail", "", "the script's report line is not in the job's logs")
    problems = []
    backend = report.get("backend")
    if backend != "nccl" or report.get("backend_class") != "ProcessGroupNCCL":
        problems.append(f"backend {backend} ({report.get('backend_class')}), not nccl: a job given a GPU "
                        f"should take NCCL under backend auto")
    if not str(report.get("device", "")).startswith("cuda"):
        problems.append(f"the tensors were on {report.get('device')}")
    if report.get("sum") != report.get("expected_sum"):
        problems.append(f"all_reduce summed to {report.get('sum')}, not {report.get('expected_sum')}")
    if report.get("pg_timeout_s") != timeout_s:
        problems.append(f"the group's options say a timeout of {report.get('pg_timeout_s')} s, not timeout_s "
                        f"{timeout_s}")
    mode = torch_says.get("error_handling")
    if mode is None or "timeout_ms" not in torch_says:
        problems.append("torch logged no ProcessGroupNCCL settings (its 'initialization options' and "
                        "'environments' lines, at TORCH_CPP_LOG_LEVEL=INFO)")
    else:
        if torch_says["timeout_ms"] != timeout_s * 1000:
            problems.append(f"torch's group timeout is {torch_says['timeout_ms']} ms, not {timeout_s * 1000}")
        if mode not in ENDS_THE_RANK:
            problems.append(f"torch's error handling is {mode} ({ERROR_HANDLING.get(mode, 'unknown')}): a "
                            f"collective that times out does not end the rank")
    env = report.get("async_error_handling_env")
    name = ERROR_HANDLING.get(mode, "?") if mode is not None else "not logged"
    detail = (f"torch's TORCH_NCCL_ASYNC_ERROR_HANDLING: {mode} ({name}), "
              f"in the rank's environment: {'unset' if env is None else env}; group timeout "
              f"{torch_says.get('timeout_ms')} ms; NCCL {report.get('nccl_version')}; all_reduce sum "
              f"{report.get('sum')} (expected {report.get('expected_sum')})")
    return verdict(check, problems, f"backend {backend}", detail)


def judge_abort(code: int, stdout: str, took: float, timeout_s: int, grace_s: float, dumps: Sequence[str] = ()) -> Row:
    """A collective NCCL's watchdog times out: the job fails with hpcdist's summary and ends within
    the timeout, the grace hpcdist gives NCCL after its summary, and 30 s for start-up and summary."""
    check = "watchdog abort: hpcdist's summary, the job ends"
    line = failed_line(stdout)
    bound = timeout_s + grace_s + 30
    problems = []
    if code != 1:
        problems.append(f"submit --wait exited {code}, not 1 (the job did not fail)")
    if ABORT_SUMMARY.format(t=timeout_s) not in line:
        problems.append(f"rank 0's line is not hpcdist's summary: {line[:200] or '(no rank 0: FAILED line)'}")
    if took > bound:
        problems.append(f"ended after {took:.0f} s, over {bound:.0f} s (timeout {timeout_s} + GRACE_S {grace_s:g} "
                        f"+ 30)")
    return verdict(check, problems, f"{took:.0f} s (bound {bound:.0f} s)",
                   f"{line[:300]}; flight recorder dump: {list(dumps)}")


def judge_bench(check: str, rows: int, wrong: int, best_gbps: float, name: str = "") -> Row:
    """A benchmark's result: rows measured, no wrong element, a bandwidth."""
    problems = []
    if rows == 0:
        problems.append("no rows measured")
    if wrong:
        problems.append(f"{wrong} wrong elements")
    if not (finite(best_gbps) and best_gbps > 0):
        problems.append(f"no bandwidth (max algbw {best_gbps})")
    return verdict(check, problems, f"{best_gbps:.1f} GB/s algbw max", f"{rows} rows, {wrong} wrong elements, {name}")


def falling_loss(losses: Sequence[float]) -> list[str]:
    """What is wrong with a run's per-step losses: too few, not finite, or the last not below the first."""
    if len(losses) < 2:
        return [f"{len(losses)} step losses recorded"]
    bad = [i for i, v in enumerate(losses) if not finite(v)]
    if bad:
        return [f"loss not finite at {len(bad)} steps (first at index {bad[0]}: {losses[bad[0]]})"]
    if not losses[-1] < losses[0]:
        return [f"the loss did not fall ({losses[0]:.4f} at the first step, {losses[-1]:.4f} at the last)"]
    return []


def judge_ddp_gpu(code: int, log: str, ranks: int, failure: str = "") -> Row:
    """examples/ddp_gpu.py through submit: completed, every rank on cuda:LOCAL_RANK under NCCL with
    its parameters there and CUDA memory used, and rank 0's epoch losses finite and falling."""
    check = "torchrun-style DDP script (examples/ddp_gpu.py)"
    if code != 0:
        return Row(check, "fail", "", failure or f"exit {code}")
    problems = []
    starts = {int(m.group(1)): m for m in re.finditer(
        r"rank (\d+)/(\d+): LOCAL_RANK (\d+), device (\S+) \((.*?)\), backend (\S+)", log)}
    dones = {int(m.group(1)): m for m in re.finditer(
        r"rank (\d+): done, parameters on (\S+), peak CUDA memory (\d+) bytes", log)}
    for r in range(ranks):
        start, done = starts.get(r), dones.get(r)
        if start is None or done is None:
            problems.append(f"rank {r} did not {'start' if start is None else 'finish'}")
            continue
        if start.group(2) != str(ranks):
            problems.append(f"rank {r} saw a world of {start.group(2)}, not {ranks}")
        if start.group(4) != f"cuda:{start.group(3)}" or start.group(6) != "nccl":
            problems.append(f"rank {r} ran on {start.group(4)} with {start.group(6)}, not cuda:LOCAL_RANK "
                            f"(cuda:{start.group(3)}) with nccl")
        if done.group(2) != start.group(4):
            problems.append(f"rank {r}'s parameters are on {done.group(2)}")
        if int(done.group(3)) <= 0:
            problems.append(f"rank {r} used no CUDA memory")
    losses = [float(v) for v in re.findall(r"^epoch \d+ loss (\S+)$", log, flags=re.M)]
    problems += falling_loss(losses)
    device = ", ".join(f"rank {r} on {m.group(4)} ({m.group(5)})" for r, m in sorted(starts.items()))
    memory = max((int(m.group(3)) for m in dones.values()), default=0)
    figure = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if len(losses) >= 2 else ""
    return verdict(check, problems, figure,
                   f"{len(losses)} epochs, {device}, peak CUDA memory {memory / 1e6:.1f} MB; no hpcdist import")


def judge_duplicate(codes: Sequence[int | None], logs: str, took: float) -> Row:
    """Two ranks given one GPU: both fail with hpcdist's refusal, not NCCL's "Duplicate GPU"."""
    ours = [ln.strip() for ln in logs.splitlines() if "were given one GPU" in ln]
    problems = []
    if any(c == 0 for c in codes):
        problems.append(f"exit codes {list(codes)}: a rank went on")
    if len(ours) < len(codes):
        problems.append(f"hpcdist's refusal ('were given one GPU') on {len(ours)} of {len(codes)} ranks")
    if "Duplicate GPU detected" in logs:
        problems.append("NCCL's 'Duplicate GPU detected' came first")
    detail = ours[0][-240:] if ours else logs.strip()[-300:]
    return verdict("two ranks on one GPU refused (bootstrap only)", problems, f"{took:.0f} s", detail)


def judge_cuda_results(returned: Mapping[str, Any], attrs: Mapping[str, Any], table: Mapping[str, Any]) -> Row:
    """CUDA tensors given to ctx.results in a function the Executor ran: numbers in the result file."""
    problems = []
    if not str(returned.get("device", "")).startswith("cuda"):
        problems.append(f"the function ran on {returned.get('device')}, not a GPU")
    if attrs.get("loss") != 2.0:
        problems.append(f"attribute loss is {attrs.get('loss')!r}, not 2.0")
    if [float(v) for v in table.get("loss", [])] != [4.0, 8.0] or [int(v) for v in table.get("n", [])] != [0, 1]:
        problems.append(f"table steps is {dict(table)}, not loss [4, 8] and n [0, 1]")
    return verdict("CUDA tensors to ctx.results (hpcdist.Executor)", problems, f"loss {attrs.get('loss')}",
                   f"on {returned.get('device')}, written to {Path(str(returned.get('result', '-'))).name}")


LOAD_BUCKET_BYTES = 64 * 2**20  # infer_gpt's default bucket_mb: what rank 0 reads and broadcasts at a time


def judge_infer(dtype: str, params: int, vocab: int, d_model: int, weight_bytes: int, kv_bytes: int,
                peak_bytes: int, load_peak_bytes: int, largest_tensor_bytes: int) -> Row:
    """infer_gpt in bfloat16: the weights held at 2 bytes a value (with the head's transposed copy),
    and `load: broadcast` streamed: the load's device peak is the model plus one bucket in flight
    and its shard on the way into the model (hpcdist.infer.broadcast_load), never the checkpoint's
    whole float32 copy beside it. A tensor bigger than a bucket (GPT-2's float32 embedding, 154 MB,
    against 64 MiB buckets) goes as a bucket of its own: `largest_tensor_bytes`, in the checkpoint's
    dtype, is then the bucket."""
    want = 2 * (params + vocab * d_model)
    problems = []
    if dtype != "bfloat16":
        problems.append(f"dtype {dtype}")
    if not abs(weight_bytes - want) < 0.01 * want:
        problems.append(f"weights hold {weight_bytes / 1e6:.0f} MB, not {want / 1e6:.0f} MB")
    bucket = max(LOAD_BUCKET_BYTES, largest_tensor_bytes)
    bound = 1.05 * weight_bytes + 2 * bucket
    if not 0 < load_peak_bytes <= bound:
        problems.append(f"the load's device peak {load_peak_bytes / 1e6:.0f} MB is not within the weights and two "
                        f"buckets of {bucket / 1e6:.0f} MB ({bound / 1e6:.0f} MB): the model was not streamed")
    return verdict("infer_gpt bfloat16 memory", problems,
                   f"weights {weight_bytes / 1e6:.0f} MB, KV {kv_bytes / 1e6:.0f} MB, "
                   f"device peak {peak_bytes / 1e6:.0f} MB, load peak {load_peak_bytes / 1e6:.0f} MB",
                   f"dtype {dtype}; ({params / 1e6:.0f}M params + the head's transposed copy) x 2 bytes = "
                   f"{want / 1e6:.0f} MB; float32 would hold twice")


def judge_staging(code: int, report: Mapping[str, Any] | None, failure: str = "") -> Row:
    """benchmarks/gpu_ckpt_staging.py's report: every check true, and the pinned copy faster than a
    pageable .cpu() (the reason it is pinned)."""
    check = "checkpoint staging of CUDA state (gpu_ckpt_staging.py)"
    if report is None:
        return Row(check, "fail", "", failure or f"exit {code}, no report written")
    problems = [f"{k} is {report.get(k)}" for k in STAGING_CHECKS if report.get(k) is not True]
    gb = float(report.get("bytes", 0)) / 1e9
    snap, pageable = float(report.get("snapshot_ms", float("nan"))), float(report.get("pageable_ms", float("nan")))
    if not (finite(snap) and finite(pageable) and snap < pageable):
        problems.append(f"the snapshot ({snap:.1f} ms) is not faster than a pageable .cpu() ({pageable:.1f} ms)")
    if code != 0 and not problems:
        problems.append(failure or f"exit {code}")
    rate = gb / snap * 1e3 if finite(snap) and snap > 0 else float("nan")
    return verdict(check, problems, f"{snap:.1f} ms for {gb:.2f} GB = {rate:.1f} GB/s",
                   f"pageable .cpu() {pageable:.1f} ms; Stager re-stage {float(report.get('restage_ms', 0)):.1f} ms; "
                   f"on {report.get('device')}")


def judge_generation(r: Mapping[str, Any]) -> Row:
    """benchmarks/infer_vs_hf.py's compare on the GPU: greedy tokens identical to transformers'."""
    t, s = r["tokens_per_s"], r["seconds"]
    return verdict(
        "generation vs transformers (in process)",
        [] if r["identical"] is True else [f"greedy tokens differ in {r['identical_in']}"],
        f"{r['ratio']:.2f}x ({t['hpcdist']:,.0f} vs {t['transformers']:,.0f} tokens/s)",
        f"batch 8, float32, latency {s['hpcdist']:.3f} s vs {s['transformers']:.3f} s per batch, greedy identical in "
        f"{r['identical_in']}: {r['identical']}, transformers {r['versions']['transformers']}",
    )

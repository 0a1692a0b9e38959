"""benchmarks/gpu_check.py and its modules (gpu_judges.py, gpu_jobs.py, gpu_rows.py), for what
runs without a GPU: the "no GPU" exit, the wheel step's messages, the MFU arithmetic, the table it
writes, and every row's judgement (a pure function of what the row's job wrote) on one passing
input and one for each way its subject can break. A few rows' jobs run for real on CPU through
`hpcdist submit`, where the GPU rows must fail and the resume comparison must pass."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import pytest

from benchmarks import gpu_check as gc
from benchmarks import gpu_jobs as jobs
from benchmarks import gpu_judges as judges
from benchmarks import gpu_rows, gpu_train_rows
from benchmarks import gpu_train_judges as train_judges
from tests.support.cli import REPO


@pytest.mark.skipif(gc.has_gpu()[0], reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == gc.NO_GPU_EXIT
    assert proc.stdout.startswith("gpu-check: no GPU: ") and proc.stdout.count("\n") == 1
    assert proc.stderr == ""
    assert not (tmp_path / "gpu_check.json").exists()


def test_make_gpu_check_runs_the_script() -> None:
    proc = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "benchmarks/gpu_check.py" in proc.stdout


def test_missing_packages_without_wheels_are_named_with_the_way_to_get_them(tmp_path: Path) -> None:
    assert gc.missing_modules(["json", "no_such_module_hpcdist"]) == ["no_such_module_hpcdist"]
    row = gc.install_missing(["submitit", "pydantic"], wheels=tmp_path / ".whl")
    assert row.status == "fail"
    assert "lacks submitit, pydantic" in row.detail and "pip download" in row.detail
    assert gc.install_missing([]).status == "ok"


def test_missing_packages_are_installed_from_the_wheels_without_an_index(tmp_path: Path) -> None:
    (tmp_path / "submitit-1.5.2-py3-none-any.whl").write_bytes(b"")
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    row = gc.install_missing(["submitit", "yaml"], wheels=tmp_path, run=fake_run)
    assert row.status == "ok" and "installed submitit, pyyaml" in row.detail
    (cmd,) = calls
    assert cmd[1:6] == ["-m", "pip", "install", "-q", "--no-index"] and cmd[-2:] == ["submitit", "pyyaml"]

    def failing(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for pyyaml\n")

    row = gc.install_missing(["yaml"], wheels=tmp_path, run=failing)
    assert row.status == "fail" and "No matching distribution found for pyyaml" in row.detail


def test_mfu_is_achieved_flops_over_the_peak() -> None:
    # GPT-2 small: ~6 * 124M + attention ~ 0.87 GFLOP per token; 200k tokens/s on a 989 TFLOP/s H100
    assert judges.mfu(0.87e9, 200_000, 989.0) == pytest.approx(0.87e9 * 2e5 / 989e12)
    assert judges.mfu(1e9, 100_000, 100.0) == pytest.approx(1.0)
    assert judges.mfu(1e9, 100_000, None) is None


def test_the_peak_is_the_named_parts_at_the_runs_precision() -> None:
    """By the exact name torch gives: an H100 PCIe or NVL is not rated as the SXM part, an A10G not as
    an A10; an fp32 run is rated against the FP32 rate, not bf16's."""
    from hpcdist.train.metrics import peak_tflops, rated_precision

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0 and peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0 and peak_tflops("NVIDIA H100 NVL", "bf16") == 835.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    # an fp32 run with TF32 matmuls (train_gpt's on CUDA) is rated at the TF32 peak, not plain FP32's
    assert rated_precision("fp32", "high") == "tf32" and rated_precision("fp32", "highest") == "fp32"
    assert rated_precision("bf16", "high") == "bf16"
    assert peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == 494.7
    assert peak_tflops("NVIDIA A10G", "bf16") is None and peak_tflops("Tesla T4", "bf16") is None


def test_the_table_is_printed_and_written_as_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [judges.Row("hpcdist env", "ok", "1 GPU(s)", "gpu 0: NVIDIA H100"),
            judges.Row("bench_p2p torch/nccl", "skip", "", "needs 2 ranks")]
    text = gc.write_table(rows, tmp_path / "out", {"gpu": "NVIDIA H100", "torch": "2.13"})
    assert "bench_p2p torch/nccl" in capsys.readouterr().out
    assert (tmp_path / "out" / "gpu_check.txt").read_text() == text and "needs 2 ranks" in text
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert data["facts"]["gpu"] == "NVIDIA H100"
    assert data["rows"][1] == {"check": "bench_p2p torch/nccl", "status": "skip", "figure": "",
                               "detail": "needs 2 ranks"}


def test_make_gpu_check_takes_the_python_whose_torch_sees_a_gpu(tmp_path: Path) -> None:
    """On a GPU machine where `make test` made .venv (CPU torch), the machine's own python3 runs the
    check; .venv's would report "no GPU"."""
    fake = tmp_path / "python3"  # a python3 on PATH whose torch sees a GPU
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    proc = subprocess.run(["make", "-n", "gpu-check", "VENV=.venv"], cwd=REPO, capture_output=True, text=True, env=env)
    assert proc.stdout.strip() == "python3 benchmarks/gpu_check.py"


# ---------------------------------------------------------------- the script on CPU


@pytest.mark.skipif(gc.has_gpu()[0], reason="this machine has a GPU")
def test_its_arguments_parse_and_without_a_gpu_main_returns_the_no_gpu_code(tmp_path: Path) -> None:
    assert gc.main(["--quick", "--out", str(tmp_path)]) == gc.NO_GPU_EXIT
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "hpcdist submit --site local" in proc.stdout


def test_what_submit_printed_is_read_back() -> None:
    out = ("submitted job 826 (ddp_gpu, kind python) to site local in 0.04 s\n"
           "  logs:   /w/logs/ddp_gpu/826/826_0_log.out\n"
           "          /w/logs/ddp_gpu/826/826_0_log.err\n"
           "  result: /w/results/ddp_gpu/826.h5\n"
           "job 826 (ddp_gpu): COMPLETED 0:00:03\n")
    got = jobs.submitted(out)
    assert got.job_id == "826" and got.result == Path("/w/results/ddp_gpu/826.h5")
    assert got.logs == [Path("/w/logs/ddp_gpu/826/826_0_log.out"), Path("/w/logs/ddp_gpu/826/826_0_log.err")]
    assert jobs.submitted("hpcdist: error: resources.gpus_per_node: 2 is not possible\n") == jobs.Submitted()


# ---------------------------------------------------------------- each row's judgement: one pass, each way broken

TORCH_NCCL_LOG = (
    "I1126 17:00:00.000000 123 ProcessGroupNCCL.cpp:981] [PG ID 0 PG GUID 0(default_pg) Rank 0] ProcessGroupNCCL "
    "initialization options: size: 1, global rank: 0, TIMEOUT(ms): {timeout_ms}, USE_HIGH_PRIORITY_STREAM: 0, "
    "SPLIT_FROM: 0, SPLIT_COLOR: -2, PG Name: 0\n"
    "I1126 17:00:00.000100 123 ProcessGroupNCCL.cpp:990] [PG ID 0 PG GUID 0(default_pg) Rank 0] ProcessGroupNCCL "
    "environments: NCCL version: 2.27.5, TORCH_NCCL_ASYNC_ERROR_HANDLING: {mode}, TORCH_NCCL_ENABLE_TIMING: 0, "
    "TORCH_NCCL_BLOCKING_WAIT: 0, TORCH_DISTRIBUTED_DEBUG: OFF, TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK: 0, "
    "TORCH_NCCL_TRACE_BUFFER_SIZE: 2000, TORCH_NCCL_NAN_CHECK: 0, TORCH_NCCL_CUDA_EVENT_CACHE: 1\n"
)


def nccl_log(mode: int = 3, timeout_ms: int = 60000, torch_logged: bool = True, **report: Any) -> str:
    fields = {"backend": "nccl", "backend_class": "ProcessGroupNCCL", "device": "cuda:0", "pg_timeout_s": 60.0,
              "async_error_handling_env": None, "sum": 1.0, "expected_sum": 1.0, "nccl_version": "2.27.5", **report}
    torch_lines = TORCH_NCCL_LOG.format(mode=mode, timeout_ms=timeout_ms) if torch_logged else ""
    return torch_lines + "INFO group ready\n" + jobs.NCCL_REPORT + json.dumps(fields) + "\n"


def test_nccl_row_passes_on_torch_own_word_and_fails_on_each_broken_part() -> None:
    ok = judges.judge_nccl(0, nccl_log(), 60)
    assert ok.status == "ok" and "TORCH_NCCL_ASYNC_ERROR_HANDLING: 3 (SkipCleanUp)" in ok.detail
    assert judges.judge_nccl(0, nccl_log(mode=1), 60).status == "ok"
    broken = {
        "backend gloo": nccl_log(backend="gloo", backend_class="ProcessGroupGloo", device="cpu"),
        "torch's error handling is 2 (CleanUpOnly)": nccl_log(mode=2),
        "torch's error handling is 0 (NoHandling)": nccl_log(mode=0),
        "torch logged no ProcessGroupNCCL settings": nccl_log(torch_logged=False),
        "torch's group timeout is 600000 ms": nccl_log(timeout_ms=600000),
        "the group's options say a timeout of 1800.0 s": nccl_log(pg_timeout_s=1800.0),
        "all_reduce summed to 2.0": nccl_log(sum=2.0),
        "the tensors were on cpu": nccl_log(device="cpu"),
        "report line is not in the job's logs": TORCH_NCCL_LOG.format(mode=3, timeout_ms=60000),
    }
    for problem, log in broken.items():
        row = judges.judge_nccl(0, log, 60)
        assert row.status == "fail" and problem in row.detail, (problem, row)
    # what the rank's environment says is shown, never taken for torch's word
    row = judges.judge_nccl(0, nccl_log(mode=2, async_error_handling_env="1"), 60)
    assert row.status == "fail" and "in the rank's environment: 1" in row.detail
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING: 0 (NoHandling)," in judges.judge_nccl(0, nccl_log(mode=0), 60).detail
    row = judges.judge_nccl(1, "", 60, "exit 1: rank 0: FAILED BootstrapError: ...")
    assert row.status == "fail" and "BootstrapError" in row.detail


def test_the_abort_row_needs_hpcdist_summary_and_an_end_in_time() -> None:
    summary = ("job 12 finished: FAILED; 0/1 ranks succeeded\n  rank 0: FAILED JobError: the job failed on rank 0 "
               "(vm): TimeoutError: all_reduce #2 (default_pg) did not complete within 5 s; NCCL's watchdog ends this "
               "rank (then killed by SIGABRT)\n")
    assert judges.judge_abort(1, summary, 35.0, 5, 15.0).status == "ok"
    assert judges.judge_abort(1, summary, 50.0, 5, 15.0).status == "ok"  # the bound itself
    late = judges.judge_abort(1, summary, 51.0, 5, 15.0)
    assert late.status == "fail" and "over 50 s" in late.detail
    done = judges.judge_abort(0, "job 12 finished: COMPLETED; 1/1 ranks succeeded\n  rank 0: ok {}\n", 40.0, 5, 15.0)
    assert done.status == "fail" and "exited 0" in done.detail and "no rank 0: FAILED line" in done.detail
    other = judges.judge_abort(1, "  rank 0: FAILED JobError: rank 0 on vm: x.py exited with code -6\n", 30.0, 5, 15.0)
    assert other.status == "fail" and "not hpcdist's summary" in other.detail


def test_a_benchmark_row_fails_without_rows_with_wrong_elements_or_without_bandwidth() -> None:
    assert judges.judge_bench("b", 156, 0, 7621.5).status == "ok"
    assert "no rows" in judges.judge_bench("b", 0, 0, 0.0).detail
    assert "3 wrong elements" in judges.judge_bench("b", 156, 3, 7621.5).detail
    assert judges.judge_bench("b", 156, 0, float("nan")).status == "fail"


TRAIN_ATTRS = {"precision": "bf16", "complete": True, "final_step": 60, "steps": 60, "tokens_per_s_median": 190_000.0,
               "flops_per_token": 0.87e9, "num_params": 124e6}
FALLING = [10.9, 9.8, 8.1, 7.0, 6.4]
SCALER = {"scale": 32768.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
          "_growth_tracker": 59}


def test_a_training_row_needs_the_precision_every_step_and_a_finite_falling_loss() -> None:
    row = train_judges.judge_training("t", TRAIN_ATTRS, FALLING, "bf16", 989.0)
    assert row.status == "ok" and "190,000 tokens/s" in row.figure and "10.900 -> 6.400" in row.detail
    broken = {
        "precision fp32, not bf16": ({**TRAIN_ATTRS, "precision": "fp32"}, FALLING),
        "stopped at step 30 of 60": ({**TRAIN_ATTRS, "final_step": 30, "complete": False}, FALLING),
        "loss not finite at 1 steps": (TRAIN_ATTRS, [10.9, float("nan"), 6.0]),
        "the loss did not fall": (TRAIN_ATTRS, [10.9, 9.0, 11.2]),
        "1 step losses recorded": (TRAIN_ATTRS, [10.9]),
    }
    for problem, (attrs, losses) in broken.items():
        row = train_judges.judge_training("t", attrs, losses, "bf16", 989.0)
        assert row.status == "fail" and problem in row.detail, (problem, row)


def test_an_fp16_row_needs_a_loss_scaler_that_stepped() -> None:
    fp16 = {**TRAIN_ATTRS, "precision": "fp16"}
    row = train_judges.judge_training("t", fp16, FALLING, "fp16", 989.0, SCALER)
    assert row.status == "ok" and "loss scale 32768 (1 steps skipped, 59 since)" in row.detail
    broken = {
        "the loss scaler was not enabled": {},
        "never stepped successfully": {**SCALER, "scale": 65536.0, "_growth_tracker": 0},
        "skipped 10 of 5 steps": {**SCALER, "scale": 64.0},
        "the loss scale is nan": {**SCALER, "scale": float("nan")},
    }
    for problem, state in broken.items():
        row = train_judges.judge_training("t", fp16, FALLING, "fp16", 989.0, state)
        assert row.status == "fail" and problem in row.detail, (problem, row)


GPT2 = {"n_layer": 12, "n_head": 12, "d_model": 768, "context": 1024, "vocab_size": 50257}
SPEED_ATTRS = {"precision": "bf16", "compiled": True, "model_config_json": json.dumps(GPT2)}
REFERENCE = {"plain_tokens_per_s": 443_915.0, "compile": True, "precision": "bf16", "device": "cuda"}


def test_the_speed_row_needs_train_gpt_at_least_as_fast_as_the_compiled_plain_loop() -> None:
    """The issue's own figures: the compiled plain loop's 443,915 tokens/s is 36.1 % MFU (6N + 6LTD,
    989 TFLOP/s); train_gpt at 460,000 passes at 1.036x, its MFU below the 40 % goal said."""
    row = train_judges.judge_speed("s", SPEED_ATTRS, 460_000.0, REFERENCE, 989.0)
    assert row.status == "ok" and row.figure == "1.036x, MFU 37.4%", row
    assert "vs 36.1%" in row.detail and "below the 40% goal" in row.detail
    assert "goal" not in train_judges.judge_speed("s", SPEED_ATTRS, 530_000.0, REFERENCE, 989.0).detail
    broken = {
        "below 1.00x": (SPEED_ATTRS, 200_480.0, REFERENCE),
        "not bf16": ({**SPEED_ATTRS, "precision": "fp32"}, 460_000.0, REFERENCE),
        "not both compiled (train_gpt False": ({**SPEED_ATTRS, "compiled": False}, 460_000.0, REFERENCE),
        "reference False": (SPEED_ATTRS, 460_000.0, {**REFERENCE, "compile": False}),
        "the reference ran on cpu": (SPEED_ATTRS, 460_000.0, {**REFERENCE, "device": "cpu"}),
        "no throughput": (SPEED_ATTRS, float("nan"), REFERENCE),
        "the reference loop wrote no figures": (SPEED_ATTRS, 460_000.0, None),
    }
    for problem, (attrs, ours, reference) in broken.items():
        row = train_judges.judge_speed("s", attrs, ours, reference, 989.0)
        assert row.status == "fail" and problem in row.detail, (problem, row)


def test_the_speed_rows_script_runs_the_plain_loop_alone(tmp_path: Path) -> None:
    """The reference side as the row submits it (here on CPU, a tiny model, eager): its figures in JSON."""
    from tests.support.train import prepare_tokens

    tokens = prepare_tokens(tmp_path, "t", words=3000)
    out = tmp_path / "ref.json"
    model = json.dumps({"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32})
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_vs_plain.py"), "--plain-only", "--device",
                           "cpu", "--model", model, "--steps", "6", "--window", "2", "--repeat", "1", "--micro", "2",
                           "--tokens", str(tokens), "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["plain_windows"] == 2 and figures["plain_tokens_per_s"] > 0 and figures["device"] == "cpu"
    assert "ratio" not in figures
    rates = figures["plain_window_rates"]  # each window, shown in the row beside train_gpt's
    assert len(rates) == 2 and sorted(rates)[0] <= figures["plain_tokens_per_s"] <= sorted(rates)[1]
    assert gpu_train_rows.thousands([432_691.0, 368_638.0]) == "433 369" and gpu_train_rows.thousands([]) == "none"


def test_the_first_half_must_stop_at_run_steps_with_a_checkpoint_that_verifies(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_00000030.h5"
    ckpt.write_bytes(b"x" * 1000)
    half = {"final_step": 30, "complete": False}
    assert train_judges.judge_saved("s", 0, half, {30: ckpt}, 30, None).status == "ok"
    done = {"final_step": 60, "complete": True}
    assert "not at run_steps 30" in train_judges.judge_saved("s", 0, done, {30: ckpt}, 30, None).detail
    assert "no checkpoint of step 30" in train_judges.judge_saved("s", 0, half, {20: ckpt}, 30, None).detail
    unverified = train_judges.judge_saved("s", 0, half, {30: ckpt}, 30, "CheckpointError")
    assert "does not verify: CheckpointError" in unverified.detail
    assert train_judges.judge_saved("s", 1, half, {30: ckpt}, 30, None, "exit 1: boom").detail == "exit 1: boom"


WHOLE = {s: 11.0 - 0.1 * s for s in range(1, 9)}


def test_an_exact_resume_must_match_every_step_and_the_weights_bit_for_bit() -> None:
    resumed = dict(WHOLE)
    ok = train_judges.judge_resume("r", WHOLE, resumed, [4], 4, exact=True, digests=("ab", "ab"))
    assert ok.status == "ok" and "final weights identical" in ok.detail
    nudged = {**WHOLE, 6: math.nextafter(WHOLE[6], 0.0)}  # one ulp
    broken = {
        "1 steps differ, the first at step 6": (nudged, [4], ("ab", "ab")),
        "it did not resume": (resumed, [], ("ab", "ab")),  # the second job started afresh
        "the runs' steps differ": ({s: v for s, v in WHOLE.items() if s != 5}, [4], ("ab", "ab")),
        "the final weights differ": (resumed, [4], ("ab", "cd")),
    }
    for problem, (losses, read_at, digests) in broken.items():
        row = train_judges.judge_resume("r", WHOLE, losses, read_at, 4, exact=True, digests=digests)
        assert row.status == "fail" and problem in row.detail, (problem, row)


def test_a_resume_without_determinism_must_match_within_the_stated_tolerance() -> None:
    noise = {s: v + 1e-4 for s, v in WHOLE.items()}
    assert train_judges.judge_resume("r", WHOLE, noise, [4], 4, exact=False, scalers=(SCALER, SCALER)).status == "ok"
    edge = {s: v + train_judges.RESUME_ATOL + train_judges.RESUME_RTOL * abs(v) * 0.99 for s, v in WHOLE.items()}
    assert train_judges.judge_resume("r", WHOLE, edge, [4], 4, exact=False).status == "ok"
    lost_moments = {s: v + (0.3 if s > 4 else 0.0) for s, v in WHOLE.items()}
    row = train_judges.judge_resume("r", WHOLE, lost_moments, [4], 4, exact=False, scalers=(SCALER, SCALER))
    assert row.status == "fail" and "4 steps outside" in row.detail
    reset = {**SCALER, "scale": 65536.0, "_growth_tracker": 30}
    row = train_judges.judge_resume("r", WHOLE, noise, [4], 4, exact=False, scalers=(SCALER, reset))
    assert row.status == "fail" and "the loss scaler's final state differs" in row.detail


DDP_LOG = """rank 0/1: LOCAL_RANK 0, device cuda:0 (NVIDIA H100 80GB HBM3), backend nccl
epoch 0 loss 0.210000
epoch 1 loss 0.050000
epoch 2 loss 0.020000
rank 0: done, parameters on cuda:0, peak CUDA memory 10485760 bytes
"""


def test_the_ddp_example_row_needs_every_rank_on_its_gpu_and_a_falling_loss() -> None:
    row = judges.judge_ddp_gpu(0, DDP_LOG, 1)
    assert row.status == "ok" and "rank 0 on cuda:0 (NVIDIA H100 80GB HBM3)" in row.detail
    broken = {
        "rank 0 ran on cpu with gloo": DDP_LOG.replace("device cuda:0", "device cpu").replace("nccl", "gloo"),
        "rank 0's parameters are on cpu": DDP_LOG.replace("parameters on cuda:0", "parameters on cpu"),
        "rank 0 used no CUDA memory": DDP_LOG.replace("10485760 bytes", "0 bytes"),
        "the loss did not fall": DDP_LOG.replace("epoch 2 loss 0.020000", "epoch 2 loss 0.300000"),
        "rank 0 did not finish": DDP_LOG.replace("rank 0: done", "rank 0: crashed"),
    }
    for problem, log in broken.items():
        row = judges.judge_ddp_gpu(0, log, 1)
        assert row.status == "fail" and problem in row.detail, (problem, row)
    two = judges.judge_ddp_gpu(0, DDP_LOG, 2)
    assert two.status == "fail" and "rank 1 did not start" in two.detail and "world of 1, not 2" in two.detail
    assert judges.judge_ddp_gpu(1, DDP_LOG, 1, "exit 1: rank 0: FAILED").status == "fail"


def test_the_example_is_a_plain_torchrun_script_for_gpus_that_prints_what_the_row_reads() -> None:
    text = (REPO / "examples" / "ddp_gpu.py").read_text()
    assert "hpcdist" not in text.split('"""', 2)[2]  # no import of it below the docstring
    for needed in ('dist.init_process_group("nccl")', 'int(os.environ["LOCAL_RANK"])', "torch.cuda.set_device",
                   "DDP(model, device_ids=[local_rank])", "DistributedSampler",
                   # the lines judge_ddp_gpu parses
                   'f"rank {rank}/{world}: LOCAL_RANK {local_rank}, device {device} (',
                   'f"backend {dist.get_backend()}"',
                   'f"epoch {epoch} loss {', 'f"rank {rank}: done, parameters on {', 'peak CUDA memory {'):
        assert needed in text, needed


def test_two_ranks_on_one_gpu_must_both_be_refused_by_hpcdist() -> None:
    ours = "ERROR ranks 0, 1 were given one GPU (GPU-9e7330d9) on vm: NCCL needs a GPU per rank"
    assert judges.judge_duplicate([1, 1], f"{ours}\n{ours}\n", 7.0).status == "ok"
    assert "a rank went on" in judges.judge_duplicate([1, 0], f"{ours}\n{ours}\n", 7.0).detail
    assert "on 1 of 2 ranks" in judges.judge_duplicate([1, 1], f"{ours}\nsomething else\n", 7.0).detail
    nccl = judges.judge_duplicate([1, 1], f"{ours}\n{ours}\nDuplicate GPU detected : rank 0 and rank 1\n", 7.0)
    assert nccl.status == "fail" and "Duplicate GPU" in nccl.detail


def test_cuda_tensors_must_reach_the_result_file_as_numbers() -> None:
    returned = {"device": "cuda:0", "result": "/w/results/x/1.h5"}
    table = {"loss": [4.0, 8.0], "n": [0, 1]}
    assert judges.judge_cuda_results(returned, {"loss": 2.0}, table).status == "ok"
    assert "ran on cpu" in judges.judge_cuda_results({**returned, "device": "cpu"}, {"loss": 2.0}, table).detail
    assert "attribute loss is None" in judges.judge_cuda_results(returned, {}, table).detail
    assert "table steps" in judges.judge_cuda_results(returned, {"loss": 2.0}, {"loss": [4.0], "n": [0]}).detail


def test_bfloat16_inference_must_hold_two_bytes_a_weight() -> None:
    params, vocab, d = 124_439_808, 50257, 768
    want = 2 * (params + vocab * d)
    embedding = 4 * vocab * d  # the checkpoint's float32 embedding: 154 MB, bigger than a 64 MiB bucket
    streamed = want + 70_000_000
    assert judges.judge_infer("bfloat16", params, vocab, d, want, 27_000_000, 836_000_000, streamed,
                              embedding).status == "ok"
    # the H100's figure (2026-11-27): the model and the embedding's own bucket beside it
    assert judges.judge_infer("bfloat16", params, vocab, d, 326_000_000, 27_000_000, 488_000_000, 488_000_000,
                              embedding).status == "ok"
    assert "weights hold" in judges.judge_infer("bfloat16", params, vocab, d, 2 * want, 1, 1, streamed,
                                                embedding).detail
    assert "dtype float32" in judges.judge_infer("float32", params, vocab, d, want, 1, 1, streamed, embedding).detail
    whole = want + 4 * (params + vocab * d)  # the checkpoint's float32 copy held beside the model
    assert "was not streamed" in judges.judge_infer("bfloat16", params, vocab, d, want, 1, 1, whole, embedding).detail
    # with small tensors only, the bound is two 64 MiB buckets beside the model
    assert "was not streamed" in judges.judge_infer("bfloat16", params, vocab, d, want, 1, 1,
                                                    want + 3 * judges.LOAD_BUCKET_BYTES, 1 << 20).detail


STAGING = {"device": "cuda", "bytes": 1_082_130_432, **dict.fromkeys(judges.STAGING_CHECKS, True),
           "snapshot_ms": 19.9, "pageable_ms": 1059.0, "restage_ms": 20.2}


def test_staging_must_be_pinned_reused_exact_and_faster_than_pageable() -> None:
    row = judges.judge_staging(0, STAGING)
    assert row.status == "ok" and "= 54.4 GB/s" in row.figure
    for key in judges.STAGING_CHECKS:
        row = judges.judge_staging(1, {**STAGING, key: False})
        assert row.status == "fail" and f"{key} is False" in row.detail
    slow = judges.judge_staging(0, {**STAGING, "snapshot_ms": 2000.0})
    assert slow.status == "fail" and "not faster than a pageable" in slow.detail
    assert judges.judge_staging(1, None, "exit 1: rank 0: FAILED").detail == "exit 1: rank 0: FAILED"


def test_the_staging_checks_are_the_scripts_own() -> None:
    spec = importlib.util.spec_from_file_location("gpu_ckpt_staging", REPO / "benchmarks" / "gpu_ckpt_staging.py")
    assert spec is not None and spec.loader is not None
    staging = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(staging)
    assert staging.CHECKS == judges.STAGING_CHECKS


def test_generation_must_give_the_same_greedy_tokens() -> None:
    r = {"identical": True, "identical_in": "torch.float64", "ratio": 3.06, "tokens_per_s": {"hpcdist": 3689.0,
         "transformers": 1207.0}, "seconds": {"hpcdist": 0.277, "transformers": 0.848},
         "versions": {"transformers": "5.17.0"}}
    assert judges.judge_generation(r).status == "ok"
    assert judges.judge_generation({**r, "identical": False}).status == "fail"


def test_hpcdist_env_must_list_the_gpus_torch_counts() -> None:
    out = "host: gpu1\ngpu 0: NVIDIA H100 80GB HBM3\n"
    assert judges.judge_env(0, out, 1).status == "ok"
    assert "lists 1 GPU(s), torch counts 2" in judges.judge_env(0, out, 2).detail
    assert "exit 1" in judges.judge_env(1, out, 1).detail


# ---------------------------------------------------------------- the rows' jobs, run for real on CPU


def test_on_cpu_the_resume_rows_jobs_run_and_a_resumed_run_equals_the_whole_one(tmp_path: Path) -> None:
    """The deterministic resume row's three submits (whole; run_steps then resubmitted), read back
    from their result files and checkpoints: on CPU, with a tiny model, bit for bit."""
    c = gpu_rows.Checker(tmp_path, quick=True, gpus=0)
    c.training.determinism()
    (row,) = c.rows
    assert row.status == "ok", row
    assert "read back at [4]" in row.detail and "final weights identical" in row.detail
    assert re.search(r"first step [0-9.]+ s, resumed first step [0-9.]+ s", row.detail), row.detail
    final = jobs.checkpoints_of(tmp_path / "det-resumed" / "checkpoints")[8]
    with h5py.File(final) as f:  # the bucket infer_gpt's streamed load sends its biggest tensor in
        sizes: list[int] = []
        f["model"].visititems(lambda _, d: sizes.append(d.nbytes) if isinstance(d, h5py.Dataset) else None)
    assert jobs.largest_tensor_bytes(final) == max(sizes)
    (whole,) = (tmp_path / "det-whole" / "results").rglob("*.h5")  # log_every 1, saved at steps 4 and 8
    assert list(jobs.window_rates(whole, 1)) == [2, 3, 4, 5, 6, 7, 8]  # step 1 (compiling, warm-up) left out
    assert re.fullmatch(r"windows after the step-4 background save [0-9.]+x those before", jobs.after_save(whole, 1, 4))
    assert "no windows on both sides" in jobs.after_save(whole, 1, 8)
    assert jobs.scaler_state(final) == {}  # fp32 on CPU: no scaler, which an fp16 row would fail
    assert "not enabled" in train_judges.scaler_problems(jobs.scaler_state(final), 8)[0]


def test_on_cpu_the_nccl_row_runs_its_script_and_fails_on_the_gloo_group(tmp_path: Path) -> None:
    c = gpu_rows.Checker(tmp_path, quick=True, gpus=0)
    c.nccl_group(timeout_s=45)
    (row,) = c.rows
    assert row.status == "fail" and "backend gloo (ProcessGroupGloo), not nccl" in row.detail
    assert "torch logged no ProcessGroupNCCL settings" in row.detail
    assert "options say a timeout" not in row.detail  # the group's own options: 45 s, as asked


def test_on_cpu_the_staging_script_runs_through_submit_and_is_judged(tmp_path: Path) -> None:
    """On CPU tensors nothing is pinned (so the row fails, naming it); the copies are still exact."""
    c = gpu_rows.Checker(tmp_path, quick=True, gpus=0)
    c.staging()
    (row,) = c.rows
    assert row.status == "fail" and "snapshot_pinned is False" in row.detail
    report = json.loads((tmp_path / "staging.json").read_text())
    assert report["snapshot_equal"] and report["background_save_equal"] and report["stager_equal"]
    assert report["buffers_reused"]


def test_only_runs_the_rows_it_names(tmp_path: Path) -> None:
    """`gpu_check.py --only WORDS`: a row whose name holds none of the words does not run."""
    c = gpu_rows.Checker(tmp_path, quick=True, gpus=0)
    c.only = ["infer_gpt"]
    ran: list[str] = []
    c.guarded("train GPT-2 small", lambda: ran.append("train"))
    c.guarded("infer_gpt bfloat16 memory", lambda: ran.append("infer"))
    assert ran == ["infer"]


def test_the_step_profile_sorts_the_kernels_an_h100_ran() -> None:
    """benchmarks/gpu_step_profile.py's classes, on kernel names from its H100 run (2026-11-27):
    cuDNN's flash attention is attention, though its name holds sm90 like the matmuls'."""
    from benchmarks.gpu_step_profile import kernel_class

    assert kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT") == "matmul"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64") == "attention"
    assert kernel_class("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::") == "optimizer"
    assert kernel_class("triton_poi_fused__log_softmax__log_softmax_backward_data__to_copy").startswith("triton")
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor") == "other"

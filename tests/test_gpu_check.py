"""benchmarks/gpu_check.py, for what runs without a GPU: the "no GPU" exit, the wheel step's
messages, the MFU arithmetic and the table it writes (the GPU checks themselves need a GPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.cli import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
assert spec is not None and spec.loader is not None
gc: ModuleType = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up
spec.loader.exec_module(gc)


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
    assert gc.mfu(0.87e9, 200_000, 989.0) == pytest.approx(0.87e9 * 2e5 / 989e12)
    assert gc.mfu(1e9, 100_000, 100.0) == pytest.approx(1.0)
    assert gc.mfu(1e9, 100_000, None) is None


def test_the_peak_is_the_named_parts_at_the_runs_precision() -> None:
    """By the exact name torch gives: an H100 PCIe or NVL is not rated as the SXM part, an A10G not as
    an A10; an fp32 run is rated against the FP32 rate, not bf16's."""
    from hpcdist.train.metrics import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0 and peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0 and peak_tflops("NVIDIA H100 NVL", "bf16") == 835.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert peak_tflops("NVIDIA A10G", "bf16") is None and peak_tflops("Tesla T4", "bf16") is None


def test_the_table_is_printed_and_written_as_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [gc.Row("hpcdist env", "ok", "1 GPU(s)", "gpu 0: NVIDIA H100"),
            gc.Row("bench_p2p torch/nccl", "skip", "", "needs 2 ranks")]
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

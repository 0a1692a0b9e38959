"""`hpcdist report` of a training result: the figures a user checks (steps, tokens/s, losses,
checkpoints written) and `--plot DIR`, the loss and validation-loss curves as a PNG."""

from __future__ import annotations

import re
from pathlib import Path

import h5py

from hpcdist.store.results import read_attrs, read_table
from tests.support import train as fx
from tests.support.cli import run_cli

# The session fixtures: the token file and the uninterrupted reference run (400 steps, a
# checkpoint every 50, validation every 100), made once.
train_root, tokens, reference = fx.train_root, fx.tokens, fx.reference


def reference_result(train_root: Path) -> Path:
    results = sorted((train_root / "reference" / "results" / "train_gpt").glob("*.h5"))
    assert len(results) == 1, results
    return results[0]


def test_report_of_a_training_result_shows_tokens_per_s_losses_and_checkpoints(
        train_root: Path, reference: Path) -> None:
    path = reference_result(train_root)
    attrs = read_attrs(path)
    with h5py.File(path, "r") as f:
        val = read_table(f["train/val"])
        steps = read_table(f["train/steps"])
    assert len(steps["loss"]) == fx.STEPS  # every step's loss is kept: the curve is the history
    result = run_cli("report", str(path))
    assert result.code == 0, result.text
    out = result.out
    assert f"steps {fx.STEPS} of {fx.STEPS}, {int(steps['tokens_seen'][-1]):,} tokens" in out
    assert f"tokens/s: {attrs['tokens_per_s_median']:,.0f} (median over steps)" in out
    assert f"loss: final {attrs['final_loss']:.4f}, validation {attrs['final_val_loss']:.4f}" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d{4})\s+\d+\.\d{2}\s+\d+\.\d{4}$", out, re.M)
    assert [(int(s), float(v)) for s, v in rows] == [(int(s), round(float(v), 4)) for s, v in
                                                     zip(val["step"], val["loss"], strict=True)], out
    assert [100, 200, 300, 400] == [int(s) for s in val["step"]]
    assert f"checkpoints: {fx.STEPS // 50} written, latest {reference}" in out
    written = re.findall(r"^\s+(\d+)\s+write\s", out, re.M)
    assert [int(s) for s in written] == list(range(50, fx.STEPS + 1, 50)), out


def test_report_plot_writes_the_loss_curves_as_a_png(train_root: Path, reference: Path, tmp_path: Path) -> None:
    import matplotlib.image

    path = reference_result(train_root)
    out_dir = tmp_path / "plots"
    result = run_cli("report", str(path), "--plot", str(out_dir))
    assert result.code == 0, result.text
    png = out_dir / f"train_gpt_{path.stem}_loss.png"
    assert f"wrote {png}" in result.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000, png.stat().st_size  # curves, labels and a legend, not a blank canvas
    image = matplotlib.image.imread(png)
    assert image.shape[0] >= 400 and image.shape[1] >= 600, image.shape
    assert image[..., :3].std() > 0.05  # drawn on: lines and text over the white background


def test_plot_of_a_result_with_no_plot_is_one_clear_line(tmp_path: Path, local_storage: list[str]) -> None:
    smoke = run_cli("submit", "jobs/smoke.yaml", "--site", "local", "--wait", *local_storage)
    assert smoke.code == 0, smoke.text
    path = re.search(r"result: (\S+)", smoke.out)
    assert path, smoke.out
    result = run_cli("report", path.group(1), "--plot", str(tmp_path / "plots"))
    assert result.code != 0 and result.out == ""
    assert result.err == (f"hpcdist: error: --plot is for benchmark and training results; {path.group(1)} "
                          f"is a smoke result\n")

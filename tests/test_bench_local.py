"""A real four-rank run on the local site (gloo), then its HDF5 file read back with h5py and with
h5dump, and the report's table, plots and comparison made from it. Four ranks, not two: at two
all_reduce's bus factor 2(n-1)/n is 1, so a missing factor would pass."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdist.bench.measure import ROW_COLUMNS
from hpcdist.store.results import read_table
from tests.support.bench import cli_process, submit

SETS = [
    "resources.nodes=1", "resources.tasks_per_node=4", "params.paths=[torch]",
    "params.ops=[all_reduce, all_gather, reduce_scatter, broadcast, barrier]", "params.min_bytes=8",
    "params.max_bytes=64K",
    "params.factor=8", "params.warmup=1", "params.iters=4",
]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench-local")
    proc, path = submit("bench_collectives", "local", root, SETS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert path is not None and path.is_file()
    return path


def test_layout_read_back_with_h5py(result: Path) -> None:
    with h5py.File(result, "r") as f:
        a = f.attrs
        assert a["format"] == "hpcdist.result" and a["bench_layout"] == 1 and bool(a["complete"]) is True
        assert a["verdict"] == "ok" and a["kind"] == "bench_collectives" and a["world_size"] == 4
        # per-rank and per-node lists are datasets (an attribute holds only about 4,000 names)
        assert len(f["hosts"]) == 4 and len(f["nodes"]) == 1  # every rank on this machine
        assert list(f["rank_nodes"][()]) == [f["nodes"][0]] * 4
        assert not {"hosts", "nodes", "rank_nodes"} & set(a)
        layout = json.loads(a["rank_layout"])
        assert [(r["rank"], r["local_rank"]) for r in layout] == [(0, 0), (1, 1), (2, 2), (3, 3)]
        assert a["version_torch"].startswith("2.") and "version_nccl" in a and "version_mpi" in a
        assert json.loads(a["params_json"])["iters"] == 4
        assert "env" in f and "interconnect" in f
        g = f["bench/all_reduce/torch"]
        assert [c.decode() if isinstance(c, bytes) else c for c in g.attrs["columns"]] == list(ROW_COLUMNS)
        t = read_table(g)
        assert t["size"].tolist() == [8, 64, 512, 4096, 32768]
        assert (t["in_place"] == 1).all() and (t["wrong"] == 0).all()
        # nccl-tests' formulas at n = 4 (doc/PERFORMANCE.md there): algbw = bytes / 1e9 / s; busbw =
        # algbw x 2(n-1)/n = 1.5 for all_reduce, (n-1)/n = 0.75 for all_gather and reduce_scatter,
        # 1 for broadcast (tests/test_bench_bandwidth.py checks the arithmetic on known times)
        assert np.allclose(t["algbw_gbps"], t["size"] / 1e9 / (t["time_us"] * 1e-6))
        assert (t["p50_us"] <= t["p99_us"]).all()
        assert g.attrs["label"] == "torch/gloo"
        for op, factor in (("all_reduce", 1.5), ("all_gather", 0.75), ("reduce_scatter", 0.75), ("broadcast", 1.0)):
            table = read_table(f[f"bench/{op}/torch"])
            assert f[f"bench/{op}/torch"].attrs["bus_factor"] == factor, op
            assert np.allclose(table["busbw_gbps"], table["algbw_gbps"] * factor), op
            assert (table["wrong"] == 0).all(), op
        ag = read_table(f["bench/all_gather/torch"])
        assert sorted(set(ag["in_place"].tolist())) == [0, 1]
        assert read_table(f["bench/barrier/torch"])["size"].tolist() == [0]


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (hdf5-tools) not installed")
def test_layout_read_back_with_h5dump(result: Path) -> None:
    out = subprocess.run(["h5dump", "-d", "/bench/all_reduce/torch/size", str(result)],
                         capture_output=True, text=True, check=True).stdout
    assert "8, 64, 512, 4096, 32768" in out
    header = subprocess.run(["h5dump", "-A", str(result)], capture_output=True, text=True, check=True).stdout
    assert 'ATTRIBUTE "complete"' in header and 'ATTRIBUTE "rank_layout"' in header
    with h5py.File(result, "r") as f:
        busbw = f["bench/all_reduce/torch/busbw_gbps"][()]
    dumped = subprocess.run(["h5dump", "-d", "/bench/all_reduce/torch/busbw_gbps", "-m", "%.17g", str(result)],
                            capture_output=True, text=True, check=True).stdout
    body = dumped.split("DATA {")[1].split("}")[0]
    values = [float(tok) for tok in re.sub(r"\(\d+\):", " ", body).replace(",", " ").split()]
    assert np.allclose(values, busbw)


def test_report_prints_an_nccl_tests_style_table_and_writes_pngs(result: Path, tmp_path: Path) -> None:
    proc = cli_process(["report", str(result), "--plot", str(tmp_path / "plots")])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "# all_reduce on torch/gloo, 4 ranks, float32" in out
    assert "out-of-place" in out and "in-place" in out and "#wrong" in out and "busbw" in out
    assert "# Avg bus bandwidth" in out and "verdict: ok" in out
    with h5py.File(result, "r") as f:
        t = read_table(f["bench/all_reduce/torch"])
    block = out.split("# all_reduce on torch/gloo")[1].split("\n\n")[0]
    row = next(line for line in block.splitlines() if line.split()[:1] == ["32768"])
    assert f"{t['busbw_gbps'][-1]:.2f}" in row.split()
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["busbw_all_gather_torch.png", "busbw_all_reduce_torch.png", "busbw_broadcast_torch.png",
                    "busbw_reduce_scatter_torch.png"]
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "plots" / "busbw_all_reduce_torch.png")
    assert img.shape[0] > 200 and img.shape[1] > 300 and img.std() > 0.01


def test_report_compares_two_results(result: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    shutil.copy(result, other)
    with h5py.File(other, "r+") as f:
        f["bench/all_reduce/torch/busbw_gbps"][...] = f["bench/all_reduce/torch/busbw_gbps"][()] * 2
    proc = cli_process(["report", str(result), "--compare", str(other)])
    assert proc.returncode == 0, proc.stderr
    cmp = proc.stdout.split("# A: ", 1)[1]
    block = cmp.split("# all_reduce on torch")[1].split("\n\n")[0]
    ratios = [line.split()[-1] for line in block.splitlines()[2:]]
    assert ratios and all(r == "2.000" for r in ratios)


def test_report_refuses_a_file_that_is_not_a_benchmark(tmp_path: Path) -> None:
    missing = cli_process(["report", str(tmp_path / "nope.h5")])
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.attrs["format"] = "something"
    foreign = cli_process(["report", str(tmp_path / "x.h5")])
    assert foreign.returncode == 2 and "is not an hpcdist result file (format 'something')" in foreign.stderr

"""Real runs of each benchmark job on the local Slurm cluster, across its two nodes n1 and n2,
on both paths (gloo and MPI through srun --mpi=pmix): results, a failing preflight, and a rank
that dies mid-sweep."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdist.bench.measure import FAULT_VAR
from hpcdist.store.results import read_facts, read_table
from tests.support import bench
from tests.support.bench import JOBS, ROOT, cli_process, make_shared_dir, storage_overrides
from tests.support.cli import require_slurm

pytestmark = [pytest.mark.slurm]


@pytest.fixture(autouse=True)
def _cluster() -> None:
    """Every test here needs the cluster: it fails under `make test` when it is down, never skips."""
    require_slurm()

SITE = "local-slurm"


def submit(job: str, site: str, root: Path, sets: list[str],
           **kwargs: object) -> tuple[subprocess.CompletedProcess[str], Path | None]:
    """`bench.submit` on n1 and n2, the nodes these tests name (the cluster has more)."""
    return bench.submit(job, site, root, ["sbatch.nodelist=n1,n2", *sets], **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    yield from make_shared_dir()

SMALL = ["params.min_bytes=8", "params.max_bytes=64K", "params.factor=8", "params.warmup=1", "params.iters=4"]


def test_collectives_on_two_nodes_both_paths(shared_dir: Path) -> None:
    proc, path = submit(
        "bench_collectives", SITE, shared_dir,
        [*SMALL, "params.ops=[all_reduce, reduce_scatter, all_to_all, barrier]", "params.paths=[torch, mpi]"],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert path is not None
    with h5py.File(path, "r") as f:
        assert bool(f.attrs["complete"]) and f.attrs["verdict"] == "ok"
        assert read_facts(f)["nodes"] == ["n1", "n2"]  # a dataset (format 2), read as the report reads it
        assert f.attrs["version_mpi"].startswith("Open MPI")
        for op in ("all_reduce", "reduce_scatter", "all_to_all"):
            for p in ("torch", "mpi"):
                t = read_table(f[f"bench/{op}/{p}"])
                assert t["size"].size >= 4 and (t["wrong"] == 0).all(), (op, p)
                assert (t["busbw_gbps"] > 0).all()
        mpi = read_table(f["bench/all_reduce/mpi"])
        assert sorted(set(mpi["in_place"].tolist())) == [0, 1]
        assert set(read_table(f["bench/all_reduce/torch"])["slowest_host"].tolist()) <= {"n1", "n2"}


def test_p2p_between_the_two_nodes(shared_dir: Path) -> None:
    proc, path = submit("bench_p2p", SITE, shared_dir, [*SMALL, "params.paths=[torch, mpi]", "params.window=4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert path is not None
    with h5py.File(path, "r") as f:
        for test in ("pingpong", "unidir", "bidir"):
            for p in ("torch", "mpi"):
                g = f[f"bench/p2p_{test}/{p}"]
                t = read_table(g)
                assert t["size"].tolist() == [8, 64, 512, 4096, 32768]
                assert (t["wrong"] == 0).all() and (t["algbw_gbps"] > 0).all()
                assert g.attrs["ranks"].tolist() == [0, 1]
        # bidirectional bandwidth counts both directions: size x 2 / time
        bi = read_table(f["bench/p2p_bidir/mpi"])
        assert np.allclose(bi["algbw_gbps"], 2 * bi["size"] / 1e9 / (bi["time_us"] * 1e-6))


def test_pair_matrix_of_the_two_nodes(shared_dir: Path) -> None:
    proc, path = submit("bench_pairs", SITE, shared_dir, ["params.paths=[torch, mpi]", "params.size=256K",
                                                          "params.iters=3", "params.window=4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert path is not None
    with h5py.File(path, "r") as f:
        for p in ("torch", "mpi"):
            g = f[f"pairs/{p}"]
            assert [n.decode() for n in g["nodes"][()]] == ["n1", "n2"]
            bw, lat = g["bandwidth_gbps"][()], g["latency_us"][()]
            assert np.isnan(bw[0, 0]) and np.isnan(bw[1, 1])
            assert bw[0, 1] > 0 and bw[1, 0] > 0 and lat[0, 1] == lat[1, 0] > 0
            assert g.attrs["rounds"] == 1


def test_pair_matrix_measures_every_rail(shared_dir: Path) -> None:
    """Two tasks per node: local rank r of n1 with local rank r of n2 is rail r, named by the
    HCA the site lists for it; both rails measured each way, at once (still one round)."""
    proc, path = submit("bench_pairs", SITE, shared_dir, [
        "resources.tasks_per_node=2", "site.network.ib_hcas=[mlx5_0, mlx5_3]", "params.size=256K",
        "params.iters=3", "params.window=4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert path is not None
    with h5py.File(path, "r") as f:
        g = f["pairs/torch"]
        assert [n.decode() for n in g["rails"][()]] == ["rail 0 (mlx5_0)", "rail 1 (mlx5_3)"]
        assert g.attrs["rail_ranks"].tolist() == [[0, 2], [1, 3]] and g.attrs["rounds"] == 1
        rails, pair = g["rail_bandwidth_gbps"][()], g["bandwidth_gbps"][()]
        assert rails.shape == (2, 2, 2)
        assert (rails[:, 0, 1] > 0).all() and (rails[:, 1, 0] > 0).all()  # every rail, both ways
        assert pair[0, 1] == rails[:, 0, 1].min() and pair[1, 0] == rails[:, 1, 0].min()
        assert (g["rail_latency_us"][()][:, 0, 1] > 0).all()


def test_preflight_fails_below_the_site_minimum_and_names_the_nodes(shared_dir: Path) -> None:
    proc, path = submit("bench_preflight", SITE, shared_dir, [
        "site.baselines.min_busbw_gbps.all_reduce=10000", "site.baselines.min_p2p_gbps=10000",
        "params.sizes_bytes=[256K]", "params.pair_size=256K", "params.iters=3",
    ])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "below the site's minimum" in proc.stdout
    assert "minimum 10000 GB/s" in proc.stdout and "nodes that fell short: n1" in proc.stdout and "n2" in proc.stdout
    assert path is not None
    with h5py.File(path, "r") as f:  # the figures are kept, with the verdict
        assert bool(f.attrs["complete"]) and f.attrs["verdict"].startswith("below minimum")
        assert "bench/all_reduce/torch" in f and "pairs/torch" in f


def test_preflight_inside_an_allocation_sets_the_exit_code(shared_dir: Path) -> None:
    """As a training script would: srun the preflight in its allocation and stop if it fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = ["srun", "-N", "2", "--ntasks-per-node=1", "--mpi=pmix", "-t", "5",
            sys.executable, "-m", "hpcdist.runtime.entry", str(JOBS / "bench_preflight.yaml"), "--site", SITE,
            "--set", "params.sizes_bytes=[64K]", "--set", "params.pair_size=64K", "--set", "params.iters=3"]
    for s in storage_overrides(shared_dir):
        base += ["--set", s]
    ok = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    short = subprocess.run([*base, "--set", "site.baselines.min_p2p_gbps=10000"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert short.returncode != 0
    # the pair that fell short, named: whichever two nodes Slurm gave the allocation (n3 and n4 when
    # an earlier test's job still held n1 or n2)
    assert re.search(r"\bn\d->n\d\b", short.stderr) and "below the site's minimum" in short.stderr, short.stderr


def test_a_rank_that_dies_mid_sweep_fails_the_job_and_keeps_the_rows(shared_dir: Path) -> None:
    proc, path = submit(
        "bench_collectives", SITE, shared_dir,
        [*SMALL, "params.ops=[all_reduce]", "params.paths=[torch]", "timeout_s=20"],
        env_extra={FAULT_VAR: "1:all_reduce:4096"},
    )
    assert proc.returncode == 1
    assert "all_reduce at size 4096 B (4K) on path torch/gloo" in proc.stdout
    assert path is not None
    with h5py.File(path, "r") as f:
        assert bool(f.attrs["complete"]) is False
        assert f.attrs["verdict"].startswith("failed at all_reduce at size 4096")
        assert read_table(f["bench/all_reduce/torch"])["size"].tolist() == [8, 64, 512]
    shown = cli_process(["report", str(path)])
    assert shown.returncode == 0 and "INCOMPLETE" in shown.stdout and "failed at all_reduce" in shown.stdout

"""Bad benchmark input is one clear error before anything launches (no scheduler involved)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdist.bench.pairs import rounds
from hpcdist.config import load_site
from hpcdist.errors import ConfigError
from hpcdist.kinds.registry import load_job

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "jobs"


def slurm_site():  # type: ignore[no-untyped-def]
    return load_site(str(ROOT / "site_configs" / "local-slurm.yaml"))


@pytest.mark.parametrize("job", ["bench_collectives", "bench_p2p", "bench_pairs", "bench_preflight"])
def test_shipped_specs_load_on_the_slurm_site(job: str) -> None:
    spec = load_job(JOBS / f"{job}.yaml", slurm_site()).spec
    assert spec.kind == job


@pytest.mark.parametrize(
    ("sets", "needles"),
    [
        (["params.min_bytes=0"], ["params", "min_bytes must be a positive size", "got 0"]),
        (["params.min_bytes=-8"], ["min_bytes must be a positive size"]),
        (["params.min_bytes=1M", "params.max_bytes=4K"], ["max_bytes 4096 is below min_bytes 1048576"]),
        (["params.ops=[allreduce]"], ["params.ops.0", "'all_reduce'", "allreduce"]),
        (["params.min_bytes=lots"], ["params.min_bytes", "not a size"]),
        (["params.paths=[nccl]"], ["params.paths.0", "'torch' or 'mpi'"]),
        (["backend=nccl"], ["backend", "nccl", "gloo or auto"]),
        (["resources.gpus_per_node=4"], ["resources.gpus_per_node", "at most 0"]),
        (["params.mpi_buffers=cuda"], ["params.mpi_buffers", "GPU buffers need resources.gpus_per_node"]),
        (["params.dtype=bfloat16"], ["params.dtype", "MPI has no half-precision type"]),
        (["params.paths=[torch]", "params.ops=[all_reduce]", "params.modes=[out_of_place]"],
         ["params.modes", "all_reduce on path torch runs only in_place"]),
    ],
)
def test_bad_collectives_input_is_one_clear_error(sets: list[str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_job(JOBS / "bench_collectives.yaml", slurm_site(), sets)
    text = str(err.value)
    assert "bench_collectives.yaml" in text
    for needle in needles:
        assert needle in text


def test_mpi_on_a_site_without_an_mpi_launcher_is_refused() -> None:
    env_mpi = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    if env_mpi:
        pytest.skip("running under an MPI launcher")
    with pytest.raises(ConfigError, match="without an MPI launcher"):
        load_job(JOBS / "bench_collectives.yaml", load_site("local"),
                  ["resources.nodes=1", "resources.tasks_per_node=2"])


def test_mpi_without_mpi4py_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # mpi4py is installed here; only its absence is faked (it cannot be uninstalled for one test)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    with pytest.raises(ConfigError, match=r"mpi4py is not installed"):
        load_job(JOBS / "bench_p2p.yaml", slurm_site(), ["params.paths=[mpi]"])


def test_pairs_need_two_nodes_and_p2p_two_ranks() -> None:
    with pytest.raises(ConfigError, match="at least 2 nodes"):
        load_job(JOBS / "bench_pairs.yaml", slurm_site(), ["resources.nodes=1"])
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        load_job(JOBS / "bench_p2p.yaml", slurm_site(), ["resources.nodes=1"])
    with pytest.raises(ConfigError, match="params.ranks"):
        load_job(JOBS / "bench_p2p.yaml", slurm_site(), ["params.ranks=[0, 5]"])


def test_unknown_operation_in_site_baselines_is_refused() -> None:
    site = load_site(str(ROOT / "site_configs" / "local-slurm.yaml"), ["baselines.min_busbw_gbps.allreduce=10"])
    with pytest.raises(ConfigError, match=r"baselines.min_busbw_gbps.allreduce"):
        load_job(JOBS / "bench_collectives.yaml", site)


def test_cli_prints_one_line_and_exits_non_zero_before_submitting() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdist.cli", "submit", str(JOBS / "bench_collectives.yaml"), "--site", "local-slurm",
         "--set", "params.max_bytes=4", "--set", "params.min_bytes=8"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "max_bytes 4 is below min_bytes 8" in proc.stderr


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_pair_rounds_cover_every_pair_once_and_no_node_twice_per_round(n: int) -> None:
    schedule = rounds(n)
    seen = [p for r in schedule for p in r]
    assert sorted(seen) == list(itertools.combinations(range(n), 2))
    for r in schedule:
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes))
    assert len(schedule) == (n - 1 if n % 2 == 0 else n)

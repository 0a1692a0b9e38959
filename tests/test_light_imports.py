"""The login-node commands stay light: rendering imports no torch, no submitit, no workload code.

Each check runs in a fresh interpreter, so what an earlier test imported cannot hide a regression.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "submitit", "numpy", "h5py", "mpi4py", "transformers")
WORKLOADS = ("hpcdist.bench", "hpcdist.train", "hpcdist.infer", "hpcdist.model", "hpcdist.runtime",
             "hpcdist.checkpoint", "hpcdist.results", "hpcdist.store", "hpcdist.data.")
# the `data` and `model` subcommands' argument parsers (argparse only), and the docstring-only package of the latter
ALLOWED = ("hpcdist.data.cli", "hpcdist.model", "hpcdist.model.cli")

PROBE = """
import contextlib, io, json, sys
from hpcdist.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:  # --help exits
        code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def modules_after(*argv: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120, check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 0, proc.stderr
    return list(out["modules"])


def heavy_in(modules: list[str]) -> list[str]:
    return [m for m in modules if (m.split(".")[0] in HEAVY or m.startswith(WORKLOADS)) and m not in ALLOWED]


@pytest.mark.parametrize(
    "argv",
    [
        ("render", "jobs/smoke.yaml", "--site", "local-slurm"),
        ("render", "jobs/smoke.yaml", "--site", "local"),
        ("submit", "--help"),
    ],
)
def test_login_commands_import_nothing_heavy(argv: tuple[str, ...]) -> None:
    assert heavy_in(modules_after(*argv)) == []


def test_rendering_a_kind_imports_only_its_own_params_module() -> None:
    modules = modules_after("render", "jobs/smoke.yaml", "--site", "local-slurm")
    assert "hpcdist.jobs.smoke" in modules
    assert "hpcdist.bench.jobs" not in modules and "hpcdist.train.params" not in modules


def test_checking_a_benchmark_spec_imports_no_torch_submitit_or_runner() -> None:
    """A kind's site check may read light helpers (the benchmark's mode table), never its runner."""
    from hpcdist.jobs.registry import get_kind, kind_names

    runners = {get_kind(k).runner.partition(":")[0] for k in kind_names()} - {"hpcdist.jobs.smoke"}
    modules = modules_after("render", "jobs/bench_collectives.yaml", "--site", "local-slurm")
    assert [m for m in modules if m.split(".")[0] in ("torch", "submitit") or m in runners] == []

"""The login-node commands stay light: rendering imports no torch, no submitit, no workload code.

Each check runs in a fresh interpreter, so what an earlier test imported cannot hide a regression.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import REPO

HEAVY = ("torch", "submitit", "numpy", "h5py", "mpi4py", "transformers")
WORKLOADS = ("hpcdist.bench", "hpcdist.train", "hpcdist.infer", "hpcdist.model", "hpcdist.runtime",
             "hpcdist.checkpoint", "hpcdist.results", "hpcdist.store", "hpcdist.data.")
# the docstring-only package of `hpcdist.model`;
# the site's node health record every Slurm render reads (standard library only: the store's package is lazy,
# its site folder's package a docstring; its writer, `hpcdist.files.atomic`, loads only to write a mark)
ALLOWED = ("hpcdist.model", "hpcdist.store", "hpcdist.store.records", "hpcdist.store.records.health",
           "hpcdist.store.records.health_marks")

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


def probe(*argv: str) -> tuple[list[str], str]:
    """The modules loaded by `hpcdist ARGV` in a fresh interpreter, and what it wrote to stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120, check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 0, proc.stderr
    return list(out["modules"]), proc.stderr


def modules_after(*argv: str) -> list[str]:
    return probe(*argv)[0]


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


def test_render_loads_logging_and_the_sweep_module_only_when_it_uses_them(tmp_path: Path) -> None:
    """`render` is the first command every user runs (issue 42, item 4): the site's node health
    record loads logging only to warn of a file it skips there, and the sweep module loads only
    for `--sweep`; both still work when they are used. Reading the record needs neither heapq
    nor the store's atomic writer (issue 56, item 7)."""
    for site in ("local-slurm", "local"):
        modules = modules_after("render", "jobs/smoke.yaml", "--site", site)
        assert {"logging", "hpcdist.config.sweep", "heapq", "hpcdist.files.atomic"} & set(modules) == set()
    planted = tmp_path / "node-health" / f"n9.{time.time_ns()}-1-a.mark.json"
    planted.parent.mkdir()
    planted.write_text("not a mark")
    modules, stderr = probe("render", "jobs/smoke.yaml", "--site", "local-slurm",
                            "--set", f"site.storage.scratch={tmp_path}")
    assert "logging" in modules and f"node health: skipped {planted}: not a mark hpcdist wrote" in stderr
    swept = modules_after("render", "jobs/smoke.yaml", "--site", "local-slurm", "--sweep", "params.label=a,b")
    assert "hpcdist.config.sweep" in swept


def test_rendering_a_kind_imports_only_its_own_params_module() -> None:
    modules = modules_after("render", "jobs/smoke.yaml", "--site", "local-slurm")
    assert "hpcdist.kinds.smoke" in modules
    assert "hpcdist.bench.params" not in modules and "hpcdist.train.params" not in modules


def test_checking_a_benchmark_spec_imports_no_torch_submitit_or_runner() -> None:
    """A kind's site check may read light helpers (the benchmark's mode table), never its runner."""
    from hpcdist.kinds.registry import get_kind, kind_names

    runners = {get_kind(k).runner.partition(":")[0] for k in kind_names()} - {"hpcdist.kinds.smoke"}
    modules = modules_after("render", "jobs/bench_collectives.yaml", "--site", "local-slurm")
    assert [m for m in modules if m.split(".")[0] in ("torch", "submitit") or m in runners] == []


def test_render_leaves_no_pydantic_switch_behind() -> None:
    """The CLI turns pydantic's plugin search off while it loads the config only: a job, sbatch
    or the local controller inherits the user's environment, and a value the user set stays."""
    probe = PROBE.replace("print(json.dumps({", "import os\nprint(json.dumps({'env': os.environ.get("
                          "'PYDANTIC_DISABLE_PLUGINS'), ")
    for env, expected in (({}, None), ({"PYDANTIC_DISABLE_PLUGINS": "logfire"}, "logfire")):
        base = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
        proc = subprocess.run(
            [sys.executable, "-c", probe, "render", "jobs/smoke.yaml", "--site", "local-slurm"], cwd=REPO,
            env={**base, **env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120, check=True,
        )
        assert json.loads(proc.stdout.strip().splitlines()[-1])["env"] == expected


SUBMIT_PROBE = """
import json, sys
import hpcdist.login.submit
from hpcdist.runtime import run_rank
modules = sorted(sys.modules)
import cloudpickle  # as submitit pickles it
print(json.dumps({"modules": modules, "pickled": len(cloudpickle.dumps(run_rank))}))
"""


def test_submit_side_imports_no_bootstrap_before_submitting() -> None:
    """`submit` loads, checks and renders as `render` does; it names the ranks' entry point
    (``hpcdist.runtime.run_rank``, pickled by reference) without importing the bootstrap, and
    reads Slurm's accounting only for a job that failed."""
    proc = subprocess.run([sys.executable, "-c", SUBMIT_PROBE], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(proc.stdout)
    modules = out["modules"]
    bootstrap = ("hpcdist.runtime.", "hpcdist.login.postmortem", "hpcdist.bench", "hpcdist.train", "hpcdist.infer")
    assert [m for m in modules if m.split(".")[0] in HEAVY or m.startswith(bootstrap)] == []
    assert out["pickled"] < 100  # a reference (module and name), not the function's code

"""Helpers for the benchmark tests: submit a bench job through the CLI and find its result file.

Imported by the tests/test_bench_*.py files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.support.cli import REPO, SHARED

ROOT = REPO
JOBS = ROOT / "jobs"


def storage_overrides(root: Path) -> list[str]:
    return [f"site.storage.{k}={root / k}" for k in ("results", "checkpoints", "scratch", "logs")]


def cli_process(
    args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "hpcdist.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=timeout,
    )


def submit(job: str, site: str, root: Path, sets: list[str], env_extra: dict[str, str] | None = None,
           timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], Path | None]:
    """`hpcdist submit JOB --site SITE --wait` with storage under `root`; returns the process and result path."""
    args = ["submit", str(JOBS / f"{job}.yaml"), "--site", site, "--wait", "--wait-timeout", str(timeout)]
    for s in [*sets, *storage_overrides(root)]:
        args += ["--set", s]
    proc = cli_process(args, env_extra, timeout=timeout + 30)
    match = re.search(r"result: (\S+\.h5)", proc.stdout)
    return proc, Path(match.group(1)) if match else None


def make_shared_dir() -> Iterator[Path]:
    """A per-test directory on the cluster's shared storage, removed afterwards (for a fixture)."""
    path = SHARED / f"t-bench-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)

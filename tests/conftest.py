"""Shared fixtures: the CLI as a user runs it, per-test storage, and the local Slurm cluster."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path("/var/tmp/hpcdist-shared")


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 240, env: dict[str, str] | None = None) -> Run:
    """`hpcdist ARGS...` in a subprocess, as a user would type it."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdist.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(autouse=True)
def job_index(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own job index (hpcdist.jobindex): a test never writes to the user's state folder."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("HPCDIST_STATE", str(state))
    return state


@pytest.fixture(autouse=True, scope="session")
def user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own cache folder (compiled templates, ``hpcdist._paths.cache_dir``): a test
    never writes to the user's. One per session: the process keeps its template environment."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


def storage_sets(root: Path) -> list[str]:
    """`--set` arguments that move every storage root of a site under `root`."""
    out = []
    for key in ("results", "checkpoints", "scratch", "logs"):
        out += ["--set", f"site.storage.{key}={root / key}"]
    return out


@pytest.fixture
def local_storage(tmp_path: Path) -> list[str]:
    return storage_sets(tmp_path / "out")


def slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%T", "-p", "cpu"], capture_output=True, text=True, check=False)
    states = proc.stdout.split()
    # "completing": a node up and finishing a job (someone else's, or the last test's)
    up = ("idle", "mix", "alloc", "comp")
    return proc.returncode == 0 and bool(states) and all(s.startswith(up) for s in states)


def require_slurm() -> None:
    """Fail (under `make test`, HPCDIST_REQUIRE_SLURM=1) or skip (elsewhere) when the cluster is down."""
    if not slurm_up():
        if os.environ.get("HPCDIST_REQUIRE_SLURM") == "1":
            pytest.fail("the local Slurm cluster is not up (make cluster-up)")
        pytest.skip("the local Slurm cluster is not up (make cluster-up)")


def require_module(name: str) -> Any:
    """`name` imported; when it is missing, fail under `make test` (HPCDIST_REQUIRE_SLURM=1: the
    dev extra installs it) and skip elsewhere, like ``require_slurm``."""
    if os.environ.get("HPCDIST_REQUIRE_SLURM") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def _shared_dir() -> Iterator[Path]:
    require_slurm()
    root = SHARED / f"t-{uuid.uuid4().hex[:10]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm_storage() -> Iterator[Path]:
    """A fresh directory on the cluster's shared storage, removed after the test."""
    yield from _shared_dir()


@pytest.fixture(scope="module")
def slurm_storage_module() -> Iterator[Path]:
    """slurm_storage shared by a module's tests: one job whose traces several tests check."""
    yield from _shared_dir()


@pytest.fixture
def separate_hosts(slurm_storage: Path) -> Path:
    """slurm_storage on a cluster whose nodes are separate hosts (cluster/up.sh's netns mode).

    Where cluster/up.sh fell back to single-host mode this fails under HPCDIST_REQUIRE_SLURM=1
    (`make test`) with up.sh's reason, and skips otherwise, as slurm_storage does.
    """
    from tests.netfault import cluster_mode

    mode = cluster_mode()
    if mode != "netns":
        message = f"the local Slurm cluster's nodes are not separate hosts: {mode}"
        if os.environ.get("HPCDIST_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return slurm_storage

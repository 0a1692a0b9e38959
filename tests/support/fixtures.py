"""The suite's fixtures, registered once as a plugin (``tests/conftest.py``'s ``pytest_plugins``)
so a session fixture is made once per session, not once per module that imports it."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import CLUSTER_TESTS, OTHER_GROUP, SHARED, SLURM_FIXTURES, missing, require_slurm, storage_sets


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the Slurm cluster goes into one xdist group, ``cluster``: with `make
    test`'s ``-n 2 --dist loadgroup`` they run one after another on one worker (a node killed or a
    link cut by one test never hits another's job, and the 2-node tests keep n1 and n2 to
    themselves), while the tests that need no cluster run on the other worker beside them.

    The tests of the clusters beside the main one (``other_clusters``: the variants and the other
    Slurm releases, each with its own controller and single-host nodes, which no node fault or cut
    link of the main cluster's tests reaches) are a group of their own, ``other_clusters``, run one
    after another beside the ``cluster`` group rather than in it: that group is the suite's longest
    path (2044 of its 2069 s on 2026-11-29), while the other worker's tests took 1298 s."""
    for item in items:
        if item.get_closest_marker("slurm") is None and set(SLURM_FIXTURES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slurm)
        if item.get_closest_marker("slurm") is not None:
            apart = item.get_closest_marker("other_clusters") is not None
            item.add_marker(pytest.mark.xdist_group(OTHER_GROUP if apart else "cluster"))
            CLUSTER_TESTS.add(item.nodeid)


@pytest.fixture(autouse=True)
def job_index(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own job index (hpcdist.login.jobindex): a test never writes to the user's state folder."""
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
        patch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))  # `hpcdist site init` writes here
        yield cache


@pytest.fixture(autouse=True)
def default_site(monkeypatch: pytest.MonkeyPatch) -> str:
    """The site of a test's job that names none: ``local``. With no $HPCDIST_SITE hpcdist takes
    Slurm wherever srun is on PATH, as it is on this machine; the tests of that rule unset it
    (``tests/test_site_discovery.py``)."""
    monkeypatch.setenv("HPCDIST_SITE", "local")
    return "local"


@pytest.fixture
def local_storage(tmp_path: Path) -> list[str]:
    return storage_sets(tmp_path / "out")


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
        missing(f"the local Slurm cluster's nodes are not separate hosts: {mode}")
    return slurm_storage


@pytest.fixture
def cpu_burner() -> Iterator[int]:
    """Two busy processes per CPU for the test's length: the test's job runs on a loaded
    machine (a cancel or a kill must not depend on the job's processes getting the CPU)."""
    import os
    import subprocess
    import sys

    count = 2 * (os.cpu_count() or 1)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield count
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()

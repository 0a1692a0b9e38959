"""The container image ranks run in (cluster/image.sh, `make image`): what a rank imports inside it,
as root (the suite's jobs) and as a member of the shared site (alice, through a user namespace)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpcdist._version import __version__
from tests.support.cli import Run, missing
from tests.support.members import require_members, run_as

# the Makefile's IMAGE; HPCDIST_IMAGE points the test at another
IMAGE = Path(os.environ.get("HPCDIST_IMAGE", "/var/tmp/hpcdist-images/bookworm"))
MOUNT_POINTS = ("/var/tmp/hpcdist-shared", "/var/tmp/hpcdist-group", "/var/tmp/hpcdist-slurm/tmpfs")

# What a rank's bootstrap imports, and where each came from.
PROBE = f"""
import json, os, h5py, hpcdist, mpi4py, numpy, pydantic, submitit, torch, xxhash
from mpi4py import MPI
print(json.dumps({{
    "hpcdist": hpcdist.__version__, "hpcdist_file": hpcdist.__file__, "torch": torch.__version__,
    "numpy": numpy.__version__, "h5py": h5py.__version__, "pydantic": pydantic.VERSION,
    "submitit": submitit.__version__, "xxhash": xxhash.VERSION, "mpi4py": mpi4py.__version__,
    "mpi": MPI.Get_library_version(), "mount_points": [os.path.isdir(p) for p in {MOUNT_POINTS!r}],
}}))
"""


@pytest.fixture(scope="module")
def image() -> Path:
    if shutil.which("ch-run") is None:
        missing("ch-run is missing: run `make system-deps` (charliecloud-runtime)")
    if not (IMAGE / ".hpcdist-image").is_file():
        missing(f"no container image at {IMAGE}: run `make image`")
    return IMAGE


def probe(run: Run) -> dict[str, object]:
    assert run.code == 0, run.text
    versions: dict[str, object] = json.loads(run.out.strip().splitlines()[-1])
    return versions


def host_open_mpi() -> str:
    """The host's Open MPI version, which the image's must equal (mpirun's daemons, Slurm's PMIx)."""
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"\(Open MPI\) (\S+)", out)
    assert match, out
    return match.group(1)


def check(versions: dict[str, object]) -> None:
    assert versions["hpcdist"] == __version__
    # the image's own copy, not this checkout on a path
    assert str(versions["hpcdist_file"]).startswith("/usr/local/lib/python3.11/dist-packages/hpcdist/")
    assert str(versions["torch"]).split("+")[0] == "2.13.0"
    assert f"Open MPI v{host_open_mpi()}" in str(versions["mpi"])
    assert versions["mount_points"] == [True] * len(MOUNT_POINTS)


def test_image_runs_what_a_rank_imports_as_root(image: Path) -> None:
    run = subprocess.run(["ch-run", str(image), "--", "python3", "-c", PROBE], cwd="/", capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "USER": "root", "HOME": "/root"})
    check(probe(Run(run.returncode, run.stdout, run.stderr)))


def test_image_runs_what_a_rank_imports_as_a_member(image: Path) -> None:
    require_members()
    check(probe(run_as("alice", "ch-run", str(image), "--", "python3", "-c", PROBE, cwd=Path("/"), timeout=60)))

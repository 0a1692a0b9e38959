"""The limits end to end (issue 63, item 3): as alice, with no site written, on the test bed's
Slurm 22.05 and each other release, a job the cluster's state makes impossible is one line
before sbatch in the cluster's words, and nothing is queued: here a reservation that is not
there (``scontrol show reservation`` of the live controller, read through ``hpcdist submit``).
The other limits are judged by the same code on captured text (test_slurm_limits)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import require_slurm
from tests.support.members import Member, member_in, require_members
from tests.support.releases import RELEASES, release_env, require_release

pytestmark = pytest.mark.slurm


@pytest.fixture(params=["22.05", *RELEASES])
def alice(request: pytest.FixtureRequest) -> Iterator[Member]:
    require_slurm()
    require_members()
    env = {} if request.param == "22.05" else release_env(request.param)
    if env:
        require_release(request.param)
    folder = Path(f"/home/alice/t-limits-{uuid.uuid4().hex[:8]}")
    try:
        yield member_in(folder, {}, **env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_reservation_that_is_not_there_is_one_line_before_sbatch(alice: Member) -> None:
    name = f"nope-{uuid.uuid4().hex[:6]}"
    said = alice.hpcdist("submit", "smoke.yaml", "--set", f"sbatch.reservation={name}")
    assert said.code == 2 and "Traceback" not in said.err, said.err
    errors = [line for line in said.err.splitlines() if line.startswith("hpcdist: error:")]
    assert len(errors) == 1 and f"there is no reservation {name!r} (scontrol show reservation:" in errors[0], said.err
    assert "Submitted" not in said.out + said.err  # nothing queued

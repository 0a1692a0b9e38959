"""``hpcdist site check`` with no site named (issue 68, item 3): on a Slurm login node it checks the
site a submit uses where none is named (the cluster, read from itself), and the one ``hpcdist
site init`` wrote when it wrote exactly one; with several it names them."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import require_slurm
from tests.support.members import NO_SITE_LINE, Member, member_in, require_members

pytestmark = pytest.mark.slurm


@pytest.fixture
def alice() -> Iterator[Member]:
    require_slurm()
    require_members()
    member = member_in(Path(f"/home/alice/t-check-{uuid.uuid4().hex[:8]}"), {})
    try:
        yield member
    finally:
        shutil.rmtree(member.folder, ignore_errors=True)


def _headers(out: str) -> list[str]:
    return [line for line in out.splitlines() if " against the Slurm cluster " in line]


def test_site_check_with_no_name_checks_the_site_submit_uses_and_the_one_written(alice: Member) -> None:
    read = alice.hpcdist("site", "check", "--no-storage")
    assert read.code == 0 and "WRONG" not in read.out, read.text
    assert NO_SITE_LINE in read.err and "Traceback" not in read.err, read.err
    (header,) = _headers(read.out)
    assert "(the site a submit uses where none is named)" in header, read.out

    assert alice.hpcdist("site", "init").code == 0
    (written,) = (alice.folder / ".config" / "hpcdist" / "sites").glob("*.yaml")
    both = alice.hpcdist("site", "check", "--no-storage")
    assert both.code == 0 and "WRONG" not in both.out, both.text
    assert [h.split(" against ")[0].split(" (", 1)[1] for h in _headers(both.out)] == [
        "the site a submit uses where none is named)", f"written by `hpcdist site init`: {written})"], both.out

    assert alice.hpcdist("site", "init", "other").code == 0
    several = alice.hpcdist("site", "check", "--no-storage")
    assert several.code == 0 and len(_headers(several.out)) == 1, several.text
    names = ", ".join(sorted(["other", written.stem]))
    assert f"2 sites written by `hpcdist site init` ({names}); `hpcdist site check NAME`" in several.err, several.err

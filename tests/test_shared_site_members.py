"""What one member of a research group makes or owns that another then uses (issue 42, item 6): a
storage root the first member's command makes, and a script in a colleague's git checkout. Run as
the test bed's ordinary users (cluster/users.sh): root ignores file modes."""

from __future__ import annotations

import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO
from tests.support.members import GROUP_ROOT, as_user, require_members


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode) & 0o777  # the permission bits (a folder keeps its parent's setgid)


@pytest.fixture
def fresh() -> Iterator[Path]:
    """A place in the group root where none of the site's four storage roots exists yet."""
    require_members()
    base = GROUP_ROOT / "scratch" / f"t-new-{uuid.uuid4().hex[:8]}"
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_a_root_the_first_members_command_makes_has_the_sites_mode_and_the_group_uses_it(fresh: Path) -> None:
    """alice's first command on the group site, under her shell's umask 077, marks a node bad: the
    scratch root it makes (and the folder above it) has storage.mode's folder form, 0750 for
    0640, not her 0700, so bob's render reads the node-health record there and excludes the
    node. Under a site mode 0600 and umask 022 the root is 0700, not the umask's 0755."""
    roots = [a for key in ("results", "checkpoints", "scratch", "logs")
             for a in ("--set", f"site.storage.{key}={fresh / key}")]
    marked = as_user("alice", "-m", "hpcdist.cli", "nodes", "--site", "local-group", *roots,
                     "--mark", "n4", "--reason", "fan failure", umask="077")
    assert marked.code == 0, marked.text
    assert (_mode(fresh), _mode(fresh / "scratch")) == (0o750, 0o750)
    assert (fresh / "scratch").owner() == "alice" and _mode(fresh / "scratch" / "node-health") == 0o750
    rendered = as_user("bob", "-m", "hpcdist.cli", "render", str(REPO / "jobs" / "smoke.yaml"), "--site",
                       "local-group", *roots)
    assert rendered.code == 0, rendered.text
    assert "#SBATCH --exclude=n4" in rendered.out

    private = fresh / "private"
    roots = [a for key in ("results", "checkpoints", "scratch", "logs")
             for a in ("--set", f"site.storage.{key}={private / key}")]
    marked = as_user("alice", "-m", "hpcdist.cli", "nodes", "--site", "local-group", *roots,
                     "--set", "site.storage.mode=0600", "--mark", "n4", "--reason", "fan", umask="022")
    assert marked.code == 0, marked.text
    assert (_mode(private), _mode(private / "scratch")) == (0o700, 0o700)


@pytest.fixture
def bobs_checkout() -> Iterator[Path]:
    """A git checkout of bob's (his files, his .git), which alice may read, holding a script."""
    require_members()
    top = Path(f"/tmp/hpcdist-t-{uuid.uuid4().hex[:8]}")
    top.mkdir(mode=0o755)
    try:
        repo = top / "bob-project"
        repo.mkdir()
        (repo / "train.py").write_text("import sys\nprint('ran', sys.argv[1:])\n")
        git = ["git", "-c", "user.name=bob", "-c", "user.email=bob@example.org"]
        subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
        subprocess.run([*git, "add", "train.py"], cwd=repo, check=True)
        subprocess.run([*git, "commit", "-q", "-m", "first"], cwd=repo, check=True)
        # his repository's config would start a program in any git that reads it (git's reason to
        # refuse a checkout of someone else's): hpcdist's listing must not start it
        subprocess.run(["git", "config", "core.fsmonitor", f"touch {top / 'fsmonitor-ran'}; false"], cwd=repo,
                       check=True)
        (repo / "notes.txt").write_text("untracked, not ignored: copied\n")
        shutil.chown(top, "alice")  # alice's working folder: the local site's hpcdist-out/ goes here
        for path in (repo, *repo.rglob("*")):
            shutil.chown(path, "bob", "bob")
        yield repo
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_script_in_a_colleagues_git_checkout_is_snapshotted_and_runs(bobs_checkout: Path) -> None:
    """alice submits a script of bob's checkout (before: git's "dubious ownership" refused the
    listing at submit): git lists it for that one call (safe.directory), no program named in his
    repository's config runs as her, and her job runs the copy of what git lists."""
    work = bobs_checkout.parent
    got = as_user("alice", "-m", "hpcdist.cli", "submit", "--site", "local", "--wait", "--",
                  str(bobs_checkout / "train.py"), "x", cwd=work)
    assert got.code == 0, got.text
    assert "1/1 ranks succeeded" in got.out, got.out
    assert not (work / "fsmonitor-ran").exists()
    (code,) = (work / "hpcdist-out" / "logs" / "train").glob("code-*")
    assert sorted(p.name for p in code.iterdir()) == ["notes.txt", "train.py"] and code.owner() == "alice"
    logs = "".join(p.read_text() for p in (work / "hpcdist-out" / "logs" / "train").glob("*/*_0_log.out"))
    assert "ran ['x']" in logs, logs

"""A research group's shared site, run as its members (issue 29): alice and bob of group mlgroup
submit at once into one group storage root (3770) under the same job names, and carol, outside the
group, reads nothing. Every user here is an ordinary account (cluster/users.sh): root ignores file
modes, so a test run as root proves nothing about them."""

from __future__ import annotations

import json
import stat
import uuid
from pathlib import Path

import pytest

from tests.support.cli import REPO, job_id
from tests.support.members import GROUP_ROOT, as_user, finish, require_members, spawn


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode) & 0o777  # the permission bits (folders keep the root's setgid)


def _owner(path: Path) -> str:
    return path.owner()


@pytest.mark.slurm
def test_two_members_submit_the_same_names_at_once_and_each_runs_in_their_own_folders() -> None:
    from tests.support.cli import require_slurm

    require_slurm()
    require_members()
    tag = uuid.uuid4().hex[:6]
    smoke, ckpt = f"smoke-{tag}", f"ckpt-{tag}"
    cli = ("-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "smoke.yaml"), "--site", "local-group",
           "--set", "resources.nodes=2", "--set", f"name={smoke}", "--wait")
    script = str(REPO / "tests" / "scripts" / "member_executor.py")
    # whatever each shell's umask: the first member's submit decides nothing for the other
    procs = {("alice", "cli"): spawn("alice", *cli, umask="002"), ("bob", "cli"): spawn("bob", *cli, umask="077"),
             ("alice", "ex"): spawn("alice", script, ckpt, umask="022"),
             ("bob", "ex"): spawn("bob", script, ckpt, umask="002")}
    runs = {key: finish(proc) for key, proc in procs.items()}
    for (user, what), run in runs.items():
        assert run.code == 0, (user, what, run.text)
    for user in ("alice", "bob"):
        out = runs[(user, "cli")].out
        assert "4/4 ranks succeeded" in out, out
        jid = job_id(out)
        result = GROUP_ROOT / "results" / user / smoke / f"{jid}.h5"
        assert result.is_file() and _owner(result) == user
        folder = GROUP_ROOT / "logs" / user / smoke / jid
        pickles = sorted(folder.glob("*_result.pkl"))
        assert len(pickles) == 4 and {_mode(p) for p in pickles} == {0o600}, pickles  # return values: private
        assert _mode(GROUP_ROOT / "scratch" / user / "rendezvous") == 0o700
        got = json.loads(runs[(user, "ex")].out.strip().splitlines()[-1])
        assert [r["rank"] for r in got["results"]] == [0, 1]
        assert {r["user"] for r in got["results"]} == {user}
        directory = Path(got["results"][0]["checkpoints"])
        assert directory == GROUP_ROOT / "checkpoints" / user / ckpt
        assert _owner(directory / "step_00000001.h5") == user
        calls = GROUP_ROOT / "logs" / user / ckpt / "calls"
        assert _mode(calls) == 0o700 and {_mode(p) for p in calls.iterdir()} == {0o600}
        assert not _mode(GROUP_ROOT / "logs" / user / ckpt) & 0o022  # storage.mode, not the shell's umask 002
    # the group reads a colleague's files (storage.mode 0640); the outsider reads nothing
    alice_ckpt = GROUP_ROOT / "checkpoints" / "alice" / ckpt / "step_00000001.h5"
    read = "import sys; print(len(open(sys.argv[1], 'rb').read()))"
    assert as_user("bob", "-c", read, str(alice_ckpt)).code == 0
    outsider = as_user("carol", "-c", read, str(alice_ckpt))
    assert outsider.code != 0 and "Permission denied" in outsider.err
    # bob's job index knows only his jobs: alice's job is not his to cancel or ask for stacks
    alice_job = job_id(runs[("alice", "cli")].out)
    for command in ("cancel", "stacks"):
        refused = as_user("bob", "-m", "hpcdist.cli", command, alice_job)
        assert refused.code != 0 and "Traceback" not in refused.text, refused.text
        assert len(refused.err.strip().splitlines()) == 1, refused.err

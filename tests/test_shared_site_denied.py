"""A member on a site whose storage is not hers (issue 68): the shipped ``local-slurm`` site's roots
are root's (0750, as root's first run of the suite made them), and alice, an ordinary member, meets
them through every door. Each door says it in one line naming the root, its owner and mode and the
key to set (or ``hpcdist site init``); the Python API raises that line as hpcdist's own error, and
no command of the CLI prints a traceback to carol, who may read none of it."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO, SHARED
from tests.support.members import as_user, require_members, run_as

ROOTS = ("results", "checkpoints", "scratch", "logs")
# what every door's line holds, whichever root it meets first
SAID = ("site.storage.", "to a folder of yours", "hpcdist site init", "(owner root, mode 0")


@pytest.fixture
def roots_of_root() -> Path:
    """The shipped site's storage as root's first submit leaves it (made here when no test made it
    yet, so no member's first run makes it hers)."""
    require_members()
    SHARED.mkdir(mode=0o755, exist_ok=True)  # as the suite's slurm_storage makes it: others' tests go through it
    for folder in (SHARED, *(SHARED / name for name in ROOTS)):
        folder.mkdir(mode=0o750, exist_ok=True)
        assert folder.owner() == "root", folder
    return SHARED


@pytest.fixture
def her_folder() -> Iterator[Path]:
    """A folder of alice's own to run from (her copy of the site goes in its site_configs/)."""
    folder = Path("/home/alice") / f"t-denied-{uuid.uuid4().hex[:6]}"
    assert run_as("alice", "mkdir", "-p", str(folder / "site_configs")).code == 0
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _one_line(err: str, site: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("hpcdist: no site named")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"hpcdist: error: site {site}: storage."), err
    for part in SAID:
        assert part in lines[0], (part, err)
    return lines[0].removeprefix("hpcdist: error: ")


@pytest.mark.parametrize("site", ["local-slurm", "mine"], ids=["the shipped site", "her copy, roots unedited"])
def test_hpcdist_submit_on_storage_not_hers_is_one_line_naming_the_root(roots_of_root: Path, her_folder: Path,
                                                                       site: str) -> None:
    shutil.copy(REPO / "site_configs" / "local-slurm.yaml", her_folder / "site_configs" / "mine.yaml")
    shutil.chown(her_folder / "site_configs" / "mine.yaml", "alice", "alice")
    got = as_user("alice", "-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "smoke.yaml"), "--site", site,
                  "--set", "resources.nodes=2", "--wait", cwd=her_folder)
    assert got.code == 2 and "submitted" not in got.out, got.text
    said = _one_line(got.err, site)
    assert f"storage.results: {roots_of_root}/results " in said and said.endswith("chmod 3770 ROOT)"), said


EXECUTORS = """
import json, socket, sys
import hpcdist
from hpcdist.errors import HpcdistError

def two(ctx: hpcdist.Context) -> int:
    return ctx.rank

said = []
doors = ((lambda: hpcdist.AutoExecutor("log_test/%j", cluster="slurm", site="local-slurm").submit(socket.gethostname)),
         (lambda: hpcdist.Executor(site="local-slurm", nodes=2).submit(two)),
         (lambda: hpcdist.init(site="local-slurm")))
for door in doors:
    try:
        door()
        said.append("went through")
    except HpcdistError as exc:
        said.append(f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        said.append(f"NOT HPCDIST'S {type(exc).__name__}: {exc}")
print(json.dumps(said))
"""


def test_an_executor_on_storage_not_hers_raises_hpcdists_error_with_the_submits_line(roots_of_root: Path,
                                                                                     her_folder: Path) -> None:
    """submitit's AutoExecutor of the issue (one task, submitit runs the function), an executor of
    two tasks (hpcdist's calls folder) and a script's hpcdist.init: the CLI's line, as hpcdist's
    own error."""
    got = as_user("alice", "-c", EXECUTORS, cwd=her_folder)
    assert got.code == 0 and "Traceback" not in got.err, got.text
    cli = as_user("alice", "-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "smoke.yaml"), "--site",
                  "local-slurm", cwd=her_folder)
    line = _one_line(cli.err, "local-slurm")
    assert json.loads(got.out) == [f"StorageDenied: {line}"] * 3, got.out


WALK = """
import contextlib, io, json, sys, traceback
from hpcdist.cli import main

S = sys.argv[1]
COMMANDS = [
    ["sites"], ["sites", "--show", "local-slurm"], ["env"], ["site", "check", "--no-storage"],
    ["site", "init", "-o", f"{S}/mine.yaml"],
    ["render", "jobs/smoke.yaml"], ["submit", "jobs/smoke.yaml"], ["submit", "--", "examples/ddp_plain.py"],
    ["jobs"], ["status", "424242"], ["logs", "424242"], ["wait", "--timeout", "1", "424242"],
    ["cancel", "424242"], ["stacks", "--wait", "1", "424242"], ["track", "sync", "424242"],
    ["report", f"{S}/results/smoke/1.h5"], ["nodes"], ["nodes", "--mark", "n1", "--reason", "slow"],
    ["nodes", "--clear", "n1"], ["data", "prepare", "README.md", "-o", f"{S}/scratch/tokens"],
    ["model", "import", f"{S}/checkpoints/hf", "-o", f"{S}/results/gpt"],
    ["model", "export", f"{S}/checkpoints/train", "-o", f"{S}/results/hf"],
    ["ckpt", "export-dcp", f"{S}/checkpoints/train", f"{S}/scratch/dcp"],
    ["ckpt", "import-dcp", f"{S}/checkpoints/dcp", "-o", f"{S}/checkpoints/back"],
]
walked = []
for argv in COMMANDS:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    walked.append({"argv": argv, "code": code, "err": err.getvalue()})
print(json.dumps(walked))
"""


def test_every_command_as_a_user_without_access_prints_no_traceback(roots_of_root: Path) -> None:
    """carol (outside the group) walks the CLI on the shipped site, storage she may not read: each
    command succeeds or ends in hpcdist's one line; none prints a traceback or dies of one."""
    got = as_user("carol", "-c", WALK, str(roots_of_root), cwd=REPO, env={"HPCDIST_SITE": "local-slurm"},
                  timeout=300)
    assert got.code == 0, got.text
    walked = json.loads(got.out)
    for run in walked:
        assert run["code"] != "raised" and "Traceback" not in run["err"], run
        errors = [line for line in run["err"].splitlines() if line.startswith("hpcdist: error:")]
        said = [line for line in run["err"].splitlines() if line.startswith(("hpcdist: ", "usage: "))]
        assert len(errors) <= 1 and (run["code"] == 0 or said), run  # (site check's "hpcdist: wrong:" lines too)
    storage = {" ".join(r["argv"]) for r in walked if "storage." in r["err"] and "site.storage." in r["err"]}
    assert {"render jobs/smoke.yaml", "submit jobs/smoke.yaml", "nodes"} <= storage, walked


def test_a_health_record_folder_she_cannot_read_is_one_line_naming_it(roots_of_root: Path) -> None:
    """Her scratch root lets her in, the record's folder in it does not (another's, 0700): `hpcdist
    nodes` and `render` name that folder and the way around it, not a PermissionError."""
    from tests.support.members import GROUP_ROOT

    scratch = GROUP_ROOT / "scratch" / f"t-record-{uuid.uuid4().hex[:6]}"
    (scratch / "node-health").mkdir(parents=True)
    scratch.chmod(0o755)
    (scratch / "node-health").chmod(0o700)
    try:
        for argv in (["nodes"], ["render", str(REPO / "jobs" / "smoke.yaml")]):
            got = as_user("alice", "-m", "hpcdist.cli", *argv, "--site", "local-slurm", "--set",
                          f"site.storage.scratch={scratch}")
            assert got.code == 2 and "Traceback" not in got.err, got.text
            assert got.err.strip() == (
                f"hpcdist: error: cannot read the node health record: {scratch}/node-health (owner root, mode 0700) "
                f"is not yours to read; ask its owner, or set site health.exclude_for_h=0 to submit without the "
                f"record"), got.err
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

"""The `python` kind's submit-time promises, as a user meets them.

A module that cannot import is one error at submit; the code snapshot leaves secrets and links
out of the tree and never widens a mode, and never copies hpcdist's own output (its storage under
the code folder); a git checkout whose git fails is an error, and an import the job will read live
from the submit folder is a warning; a rank that finishes long after rank 0 is not killed.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from tests.support.cli import REPO, run_cli, storage_sets

RANKS = REPO / "tests" / "scripts" / "ranks.py"


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcdist: error: "), err
    return lines[0]


@pytest.mark.parametrize(("body", "expected"), [
    ("import no_such_dependency_xyz\nprint('trained')\n",
     r"params\.module: 'pkg\.train' .* it imports no_such_dependency_xyz \(line 1\), which is not installed"),
    ("def main(:\n    pass\n", r"params\.module: 'pkg\.train' .* SyntaxError: .*train\.py, line 1\)"),
    ("print('trained')\n", None),  # the body of a -m module is the program: never run at submit
], ids=["missing-import", "syntax-error", "fine"])
def test_a_module_that_cannot_import_is_one_error_at_submit(tmp_path: Path, body: str, expected: str | None) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(body)
    root = tmp_path / "out"
    result = run_cli("render", "--site", "local-slurm", *storage_sets(root), "--", "-m", "pkg.train", cwd=tmp_path)
    if expected is None:
        assert result.code == 0 and "trained" not in result.text, result.text
        return
    assert result.code == 2, result.text
    assert re.search(expected, one_error_line(result.err)), result.err


def test_a_failing_git_in_a_checkout_is_an_error(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('ran')\n")
    (code / ".env").write_text("AWS_SECRET_ACCESS_KEY=hunter2\n")
    (code / ".git").write_text(f"gitdir: {tmp_path / 'gone'}\n")  # a worktree whose repository is gone
    root = tmp_path / "out"
    result = run_cli("submit", "--site", "local", *storage_sets(root), "--wait", "--", str(code / "train.py"))
    assert result.code == 2, result.text
    line = one_error_line(result.err)
    assert f"is in the git checkout {code}, but `git ls-files` failed there" in line, line
    assert "params.snapshot=false" in line
    assert not (root / "logs").exists()


def test_the_snapshot_leaves_secrets_out_keeps_modes_and_names_live_imports(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    pkg = proj / "pkg"
    (pkg / ".aws").mkdir(parents=True)
    (proj / "helpers.py").write_text("X = 7\n")  # a sibling of the package: imported from the submit folder
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import helpers\nprint('helpers', helpers.X)\n")
    (pkg / "private.py").write_text("P = 1\n")
    os.chmod(pkg / "private.py", 0o600)
    (pkg / ".env").write_text("HF_TOKEN=hf_abc\n")
    (pkg / ".aws" / "credentials").write_text("[default]\naws_secret_access_key=xyz\n")
    (pkg / "credentials.json").write_text("{}\n")
    (pkg / "server.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (pkg / ".hidden_notes").write_text("x\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("not the code's\n")
    (pkg / "link.txt").symlink_to(outside)
    root = tmp_path / "out"
    result = run_cli("submit", "--site", "local", "--set", "resources.tasks_per_node=1", *storage_sets(root),
                     "--wait", "--", "-m", "pkg.train", cwd=proj, timeout=180)
    assert result.code == 0, result.text
    snap = next((root / "logs" / "train").glob("code-*")) / "pkg"
    assert sorted(p.name for p in snap.iterdir()) == ["__init__.py", "private.py", "train.py"]
    assert stat.S_IMODE((snap / "private.py").stat().st_mode) == 0o600  # never wider than the source
    assert stat.S_IMODE((snap / "train.py").stat().st_mode) & 0o007 == 0
    left = next(line for line in result.err.splitlines() if "leaves out" in line)
    for name, why in ((".env", "secret-looking name"), (".aws", "dot-folder"), ("credentials.json", "secret"),
                      ("server.pem", "secret"), (".hidden_notes", "dot-file"), ("link.txt", "a link out of the tree")):
        assert re.search(rf"{re.escape(name)} \([^)]*{why}", left), left
    live = [line for line in result.err.splitlines() if "outside the snapshot" in line]
    assert len(live) == 1 and f"imports helpers from {proj / 'helpers.py'}" in live[0], result.err


@pytest.mark.parametrize("storage", ["default", "set"])
def test_a_second_submit_snapshots_none_of_the_firsts_output(tmp_path: Path, storage: str) -> None:
    """PyTorch's DDP tutorial in a folder of its own, not a git checkout, submitted twice from
    there: the local site's default storage (``hpcdist-out/``), or every root set under the folder
    by other names. The second snapshot holds the script alone, the first job's checkpoint does not
    count against the size limit, and no warning names the first job's files."""
    code = tmp_path / "tutorial"
    code.mkdir()
    (code / "multinode.py").write_text("print('trained')\n")
    sets = [] if storage == "default" else storage_sets(code / "runs")
    ckpt = code / ("hpcdist-out/checkpoints" if storage == "default" else "runs/checkpoints") / "multinode"
    argv = ("submit", "--site", "local", *sets, "--set", "params.snapshot_max_mb=1", "--wait", "--", "multinode.py")
    first = run_cli(*argv, cwd=code)
    assert first.code == 0, first.text
    ckpt.mkdir(parents=True)
    (ckpt / "step_100.h5").write_bytes(b"\0" * 2_000_000)  # over the limit, were it copied
    second = run_cli(*argv, cwd=code)
    assert second.code == 0, second.text
    assert "warning" not in second.err, second.err
    logs = code / ("hpcdist-out/logs" if storage == "default" else "runs/logs") / "multinode"
    snaps = sorted(logs.glob("code-*"), key=lambda p: p.stat().st_mtime)
    assert len(snaps) == 2, snaps
    assert sorted(str(p.relative_to(snaps[1])) for p in snaps[1].rglob("*")) == ["multinode.py"]


def test_the_snapshot_leaves_the_executors_folder_out_unsaid(tmp_path: Path) -> None:
    """``AutoExecutor("log_%j")`` run twice from the code folder (issue 63): every ``log_<id>`` it
    made, and any job's own files another Executor's folder holds (``log_test/``), are hpcdist's
    output, neither copied nor warned of; a secret of the user's is still named."""
    from hpcdist.kinds import snapshot

    (tmp_path / "mylib.py").write_text("def double(x):\n    return 2 * x\n")
    for rel in ("log_41/41_store.key", "log_41/41_0_log.out", "log_42_3/42_3_submitted.pkl",
                "log_test/40_store.key", "log_test/40_0_result.pkl", "log_test/40/40_0_log.err", "notes/.env"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    listing = snapshot.files(tmp_path, [tmp_path / "log_%j"])
    assert [str(p) for p in listing.files] == ["mylib.py"]
    assert {str(p): why for p, why in listing.left_out.items()} == {"notes/.env": "a secret-looking name"}


def test_a_rank_finishing_long_after_rank_0_is_not_killed(local_storage: list[str]) -> None:
    """Rank 0's end-of-job wait outlasts `timeout_s` while a rank still works (and shows it is alive)."""
    result = run_cli("submit", "--site", "local", "--set", "resources.tasks_per_node=2", "--set", "timeout_s=3",
                     *local_storage, "--wait", "--", str(RANKS), "late", "late", "1", "7", timeout=180)
    assert result.code == 0, result.text
    assert "2/2 ranks succeeded" in result.out, result.out


def test_import_check_runs_outside_the_submitting_process(tmp_path: Path) -> None:
    """A module whose import ends the interpreter cannot end `hpcdist render` with it."""
    (tmp_path / "quitter.py").write_text("import sys\nsys.exit(5)\ndef main():\n    pass\n")
    result = run_cli("render", "--site", "local-slurm", "--set", "params.function=quitter:main", "--set",
                     "params.script=null", "--", str(RANKS), cwd=tmp_path)
    assert result.code == 2, result.text
    assert "a callable; importing quitter failed: SystemExit: 5" in one_error_line(result.err)


def test_another_user_cannot_stop_the_job_through_its_store(tmp_path: Path) -> None:
    """The store listens on the published address only, and hpcdist's messages carry the job's MAC:
    the failure key the intruder sets under hpcdist's own name is logged and ignored."""
    root = tmp_path / "out"
    result = run_cli("submit", "--site", "local", "--set", "resources.tasks_per_node=2", *storage_sets(root),
                     "--wait", "--", str(REPO / "tests" / "scripts" / "intruder.py"), timeout=180)
    logs = "".join(p.read_text() for p in (root / "logs" / "intruder").glob("*/*_log.*"))
    assert "intruder set its keys" in logs, result.text + logs
    assert result.code == 0 and "2/2 ranks succeeded" in result.out, result.text
    assert "hpcdist/failed in the job's store (21 bytes; its MAC is not this job's)" in logs, logs
    # 127.0.0.1 on a one-node job (/proc/net/tcp's little-endian hex), never 0.0.0.0 or ::
    assert "store listens on ['0100007F']" in logs, logs

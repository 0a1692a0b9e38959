"""A colleague in the same group cannot make your folders, swap what you read or change your code
under a running job (issue 41, attacks 1, 2, 3 and 6): run as the test bed's ordinary members
(cluster/users.sh) on a group root of the test's own, made as an admin makes one (root:mlgroup,
3770), with the local scheduler: what is checked is the storage, not Slurm."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO
from tests.support.members import GROUP_ROOT, as_user, require_members, run_as

HOOK = REPO / "tests" / "scripts" / "swap_hook"
ROOTS = ("logs", "results", "checkpoints", "scratch")


@pytest.fixture
def site() -> Iterator[Path]:
    """A group root (root:mlgroup 3770, its four storage roots too) and its local-scheduler site
    file; yields the site file, the root beside it."""
    require_members()
    root = GROUP_ROOT / "scratch" / f"t-trust-{uuid.uuid4().hex[:8]}"
    for folder in (root, *(root / name for name in ROOTS)):
        folder.mkdir()
        shutil.chown(folder, "root", "mlgroup")
        folder.chmod(0o3770)
    site_file = root / "site.yaml"
    site_file.write_text(
        "name: trustbed\nscheduler: local\npartitions:\n  local:\n    nodes: 1\n    cpus_per_node: 8\n"
        "    gpus_per_node: 0\n    max_time_min: 60\nlauncher:\n  kind: local\nenv:\n  OMP_NUM_THREADS: 1\n"
        "storage:\n" + "".join(f"  {name}: {root / name}\n" for name in ROOTS)
        + "defaults:\n  time_min: 10\n  timeout_s: 60\n")
    site_file.chmod(0o644)
    yield site_file
    shutil.rmtree(root, ignore_errors=True)


def _submit(user: str, site: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    run = as_user(user, "-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "smoke.yaml"), "--site", str(site),
                  "--set", "resources.tasks_per_node=1", *args, env=env)
    return run.code, run.out, run.err


EXECUTOR = """
import sys
import hpcdist
from hpcdist.errors import HpcdistError
try:
    hpcdist.Executor(site=sys.argv[1], name="sq-exec", tasks_per_node=1).submit(abs, -1)
except HpcdistError as exc:
    sys.exit(f"hpcdist: error: {exc}")
"""


@pytest.mark.parametrize("mode", ["3770", "2750"])
def test_a_folder_another_member_made_for_you_is_refused_naming_who_made_it(site: Path, mode: str) -> None:
    """Attacks 1 and 6: bob makes alice's <root>/alice before she ever uses the root. 3770: her
    jobs would run in a folder whose owner renames anything in it; 2750: her submit failed,
    telling her the admin must chmod the root."""
    squatted = site.parent / "logs" / "alice"
    assert run_as("bob", "sh", "-c", f"mkdir {squatted} && chmod {mode} {squatted}").code == 0
    if mode == "3770":
        code, out, err = _submit("alice", site, "--set", f"name=sq-{mode}")
    else:  # from Python: the executor's calls are not written into bob's folder either
        run = as_user("alice", "-c", EXECUTOR, str(site))
        code, out, err = run.code, run.out, run.err
    assert code != 0, out
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{squatted} (owner bob, mode {int(mode, 8) | 0o2000:04o})" in err or f"{squatted} (owner bob" in err, err
    assert "bob made it" in err and f"rm -r {squatted}" in err, err
    assert "chmod 3770 ROOT" not in err, err  # not the root's mode: bob's folder is the cause
    assert list(squatted.iterdir()) == [], "nothing of alice's was written into bob's folder"
    # once it is gone, her first submit makes her own, and the job runs
    shutil.rmtree(squatted)
    code, out, err = _submit("alice", site, "--set", f"name=sq-{mode}", "--wait")
    assert code == 0, out + err
    assert squatted.owner() == "alice" and not squatted.stat().st_mode & 0o022


SCRIPT = """
import os, sys, time
go = sys.argv[1]
open(go + ".started", "w").close()
for _ in range(600):
    if os.path.exists(go):
        break
    time.sleep(0.05)
import evalutil
print("EVAL", evalutil.WHO, flush=True)
"""


def test_the_code_a_job_was_submitted_with_cannot_be_changed_under_it(site: Path) -> None:
    """Attack 3: once alice's script runs, bob moves her job's folder aside and puts a copy whose
    snapshot holds his evalutil.py, which her script imports later. Her folders are hers: the
    kernel refuses his rename and his write, and the script imports the code it was submitted with."""
    tmp_path = site.parent / "alice-home"
    code_dir = tmp_path / "code"
    code_dir.mkdir(parents=True)
    (code_dir / "train.py").write_text(SCRIPT)
    (code_dir / "evalutil.py").write_text("WHO = 'alice'\n")
    spec = code_dir / "train.yaml"
    spec.write_text("name: attack3\nkind: python\nresources:\n  nodes: 1\n  tasks_per_node: 1\n"
                    f"params:\n  script: {code_dir / 'train.py'}\n  args: ['{tmp_path / 'go'}']\n")
    for path in (tmp_path, code_dir, *code_dir.iterdir()):
        shutil.chown(path, "alice")
    tmp_path.chmod(0o777)  # root touches the go file
    submitted = as_user("alice", "-m", "hpcdist.cli", "submit", str(spec), "--site", str(site))
    assert submitted.code == 0, submitted.text
    started = tmp_path / "go.started"
    for _ in range(600):
        if started.exists():
            break
        threading.Event().wait(0.05)
    assert started.exists(), submitted.text
    mine = site.parent / "logs" / "alice" / "attack3"
    snapshot = next(mine.glob("code-*"))
    moved = run_as("bob", "mv", str(mine), f"{mine}.x")
    assert moved.code != 0 and "Permission denied" in moved.err, moved.text
    planted = run_as("bob", "sh", "-c", f"echo \"WHO = 'bob'\" > {snapshot}/evalutil.py")
    assert planted.code != 0, planted.text
    (tmp_path / "go").touch()
    waited = as_user("alice", "-m", "hpcdist.cli", "wait", "--site", str(site), _job(submitted.out))
    assert waited.code == 0, waited.text
    log = "".join(p.read_text() for p in mine.rglob("*.out"))
    assert "EVAL alice" in log and "EVAL bob" not in log, log


def _job(out: str) -> str:
    for word in out.split():
        if word.startswith("local-") or word.isdigit():
            return word.rstrip(".,:")
    raise AssertionError(out)


PAYLOAD = "import os, pickle, sys\nclass Run:\n    def __reduce__(self):\n        return (os.system, " \
          "('touch ' + sys.argv[2],))\nopen(sys.argv[1], 'wb').write(pickle.dumps(Run()))\n"


@pytest.mark.parametrize("suffix", ["_submitted.pkl", "_result.pkl"])
def test_a_pickle_swapped_between_the_check_and_the_read_changes_nothing(site: Path, suffix: str) -> None:
    """Attack 2, made deterministic: the moment the trust check of alice's pickle has passed (her
    rank's submitit pickle; the result pickle her own `submit --wait` reads), the test swaps the
    file for one of bob's that runs code when unpickled. What was read is what was checked."""
    tmp_path = site.parent / "swap"  # the swap is a rename on the same file system
    tmp_path.mkdir()
    tmp_path.chmod(0o777)
    go, done, marker = tmp_path / "go", tmp_path / "done", tmp_path / "ran-as-alice"
    for fifo in (go, done):
        os.mkfifo(fifo)
        fifo.chmod(0o666)
    bobs = tmp_path / "bobs.pkl"
    assert as_user("bob", "-c", PAYLOAD, str(bobs), str(marker)).code == 0
    swapped: list[str] = []

    def swap() -> None:
        with open(go) as f:
            target = f.read()
        os.rename(bobs, target)
        swapped.append(target)
        with open(done, "w") as f:
            f.write("ok")

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    env = {"PYTHONPATH": f"{HOOK}:{REPO}", "HPCDIST_TEST_SWAP": suffix,
           "HPCDIST_TEST_SWAP_GO": str(go), "HPCDIST_TEST_SWAP_DONE": str(done)}
    code, out, err = _submit("alice", site, "--set", f"name=swap{suffix[1:4]}", "--wait", env=env)
    thread.join(5)
    assert swapped and swapped[0].endswith(suffix), (out, err)
    assert not marker.exists(), "bob's pickle ran as alice"
    assert "finished: COMPLETED" in out, out + err
    if suffix == "_submitted.pkl":  # the rank ran alice's call, read from the file that was checked
        assert code == 0 and "1/1 ranks succeeded" in out, out + err
    else:  # alice's result was read; a later look at the file (now bob's) refuses it, naming it
        assert "1/1 ranks succeeded" in out or "(owner bob, mode 0644) belongs to another user" in out, out


LEFT_BEHIND = """
import json, sys
from pathlib import Path
from hpcdist.config.tracking import read_identity
from hpcdist.errors import HpcdistError
from hpcdist.runtime.requeue import requeued_runs
from hpcdist.store.records import node_failures
folder = Path(sys.argv[1])
try:
    read_identity(folder / "tracking")
    print("IDENTITY read")
except HpcdistError as exc:
    print("IDENTITY refused", exc)
print("FAILURES", len(node_failures.read(folder / "1.node_failures.json")))
print("REQUEUES", sorted(requeued_runs(folder / "requeues.txt")))
"""


def test_files_a_member_left_in_a_folder_that_was_once_the_groups_are_not_read() -> None:
    """bob's files in alice's job folder (made while her <root>/alice was group-writable): his
    tracking identity (its server gets her metrics), node failure record and requeue record (issue
    54, item 9). Called as alice through the readers themselves: the trackers are not installed in
    the test bed's venv, and the records are read for Slurm jobs only (hpcdist jobs, the requeued
    run's check)."""
    require_members()
    root = GROUP_ROOT / "logs" / f"t-left-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir()
        shutil.chown(root, "alice", "mlgroup")
        root.chmod(0o2770)  # once the group's
        plant = ("import json, os, sys; d = sys.argv[1]; os.makedirs(d + '/tracking'); "
                 "open(d + '/tracking/run.json', 'w').write(json.dumps({'key': 'k', 'name': 'x', 'created': 0, "
                 "'mlflow_uri': 'http://bob.example:5000'})); "
                 "open(d + '/1.node_failures.json', 'w').write(json.dumps([{'node': 'n1', 'when': 'x', 'run': 1, "
                 "'excluded_at': 0}])); open(d + '/requeues.txt', 'w').write('run 1 requeued: x\\n')")
        assert as_user("bob", "-c", plant, str(root / "job"), umask="022").code == 0
        root.chmod(0o750)  # hers again (own_folder closes it): bob's files stay
        got = as_user("alice", "-c", LEFT_BEHIND, str(root / "job"))
        assert got.code == 0, got.text
        assert "IDENTITY refused" in got.out and "belongs to another user" in got.out, got.out
        assert "FAILURES 0" in got.out and "REQUEUES []" in got.out, got.out
        assert got.err.count("ignoring the node failure record") == 1, got.err
        assert got.err.count("ignoring the job's requeue record") == 1, got.err
    finally:
        shutil.rmtree(root, ignore_errors=True)

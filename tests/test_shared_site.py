"""A research group's shared site, run as its members (issue 29): alice and bob of group mlgroup
submit at once into one group storage root (3770) under the same job names, and carol, outside the
group, reads nothing. Every user here is an ordinary account (cluster/users.sh): root ignores file
modes, so a test run as root proves nothing about them."""

from __future__ import annotations

import json
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO, job_id
from tests.support.members import GROUP_ROOT, as_user, finish, require_members, spawn


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode) & 0o777  # the permission bits (folders keep the root's setgid)


def _owner(path: Path) -> str:
    return path.owner()


@pytest.fixture
def tag() -> Iterator[str]:
    """A tag for this test's job names; their folders under every member's roots go afterwards."""
    tag = uuid.uuid4().hex[:6]
    yield tag
    for folder in GROUP_ROOT.glob(f"*/*/*-{tag}"):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slurm
def test_two_members_submit_the_same_names_at_once_and_each_runs_in_their_own_folders(tag: str) -> None:
    from tests.support.cli import require_slurm

    require_slurm()
    require_members()
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
    for command in ("cancel", "stacks", "logs", "wait"):
        refused = as_user("bob", "-m", "hpcdist.cli", command, alice_job)
        assert refused.code != 0 and "Traceback" not in refused.text, refused.text
        assert len(refused.err.strip().splitlines()) == 1, refused.err
        assert f"job {alice_job} is alice's, not yours" in refused.err


@pytest.fixture
def group_folder() -> Iterator[Path]:
    """A folder of the group root that every member may write, as a site with a group-writable
    layout (or a member working around one) would leave: the ground the attacks below need."""
    require_members()
    folder = GROUP_ROOT / "scratch" / f"t-open-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    shutil.chown(folder, "bob", "mlgroup")
    folder.chmod(0o2770)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


PAYLOAD = """
import os, pickle, sys
class Run:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
open(sys.argv[1], "wb").write(pickle.dumps(Run()))
"""


def _plant_pickle(path: Path, marker: Path) -> None:
    assert as_user("bob", "-c", PAYLOAD, str(path), str(marker)).code == 0


def test_a_planted_endpoint_is_refused_at_once_not_after_the_timeout(group_folder: Path) -> None:
    folder = group_folder / "rendezvous"
    plant = ("import json, os, sys; os.makedirs(sys.argv[1], mode=0o770, exist_ok=True); "
             "open(os.path.join(sys.argv[1], '77.0.0.0.json'), 'w').write(json.dumps("
             "{'addr': '127.0.0.1', 'port': 1, 'nonce': 'x'}))")
    assert as_user("bob", "-c", plant, str(folder), umask="002").code == 0
    rank1 = ("import sys, time; from pathlib import Path; from hpcdist.runtime import group; "
             "from hpcdist.runtime.rankinfo import RankInfo\n"
             "env = {'SLURM_PROCID': sys.argv[2], 'SLURM_NTASKS': '2', 'SLURM_JOB_ID': '77', 'SLURM_LOCALID': "
             "sys.argv[2], 'SLURM_NNODES': '1', 'SLURM_JOB_NODELIST': 'n1', 'SLURM_NODEID': '0'}\n"
             "t = time.monotonic()\n"
             "try:\n"
             "    group.open_store(RankInfo.from_env(env), 60, rendezvous_dir=Path(sys.argv[1]), key='77.0.0.0')\n"
             "except Exception as exc:\n"
             "    print(f'{time.monotonic() - t:.1f}', exc)\n")
    waiting = as_user("alice", "-c", rank1, str(folder), "1")
    seconds, _, message = waiting.out.strip().partition(" ")
    assert float(seconds) < 5, waiting.text  # not the 60 s timeout
    assert "refuses the endpoint" in message and "owner bob" in message, message
    # alice's rank 0 does not publish into a folder that is not hers
    serving = as_user("alice", "-c", rank1, str(folder), "0")
    assert "private folder must be a folder of your own" in serving.out and "owner bob" in serving.out, serving.text


def test_a_replaced_call_or_submitit_pickle_is_refused_and_nothing_runs(group_folder: Path) -> None:
    marker = group_folder / "ran"
    call = group_folder / "call.pkl"
    _plant_pickle(call, marker)
    run_call = ("import sys; from types import SimpleNamespace; from hpcdist.kinds.python_run import _call\n"
                "try:\n    _call(SimpleNamespace(call=sys.argv[1]))\nexcept Exception as exc:\n    print(exc)\n")
    refused = as_user("alice", "-c", run_call, str(call))
    assert "refusing to read" in refused.out and "owner bob" in refused.out, refused.text
    # submitit's pickle, as the rank's task runner reads it
    _plant_pickle(group_folder / "77_submitted.pkl", marker)
    runner = as_user("alice", "-m", "hpcdist.runtime.task_runner", str(group_folder),
                     env={"_TEST_CLUSTER_": "slurm", "SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                          "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1"})
    assert runner.code == 1 and runner.err.count("\n") == 1, runner.text
    assert "77_submitted.pkl" in runner.err and "owner bob" in runner.err
    assert not marker.exists()


def test_a_fifo_a_link_or_a_forged_author_in_the_health_folder_blocks_nothing(group_folder: Path) -> None:
    health = group_folder / "node-health"
    # the record's folder as its admin makes it (3770; bob owns the folder above, so he is its admin)
    hostile = ("import json, os, sys, time; d = sys.argv[1]; os.makedirs(d, exist_ok=True); os.chmod(d, 0o3770)\n"
               "t = time.time_ns()\n"
               "os.mkfifo(os.path.join(d, f'n1.{t}-1-a.mark.json'))\n"
               "os.symlink('/dev/zero', os.path.join(d, f'n2.{t}-1-b.mark.json'))\n"
               "open(os.path.join(d, f'n3.{t}-1-c.mark.json'), 'w').write(json.dumps({'node': 'n3', 'reason': 'slow', "
               "'when': time.time(), 'job_id': '1', 'source': 'user', 'user': 'alice', 'host': 'x'}))\n"
               "open(os.path.join(d, f'n5.{t}-1-d.mark.json'), 'w').write('{garbled')\n"
               "open(os.path.join(d, f'n6.{t}-1-e.mark.json'), 'w').write(' ' * 100000)\n")
    assert as_user("bob", "-c", hostile, str(health), umask="027").code == 0  # (a 0664 mark is skipped)
    read = ("import sys; from pathlib import Path; from hpcdist.store.records import health\n"
            "print([(m.node, m.user) for m in health.bad_nodes(Path(sys.argv[1]), 3600)])\n")
    got = as_user("alice", "-c", read, str(health), timeout=30)
    assert got.code == 0, got.text
    assert got.out.strip() == "[('n3', 'bob')]"  # the author is the file's owner, not what it says
    assert "a fifo" in got.err and "symbolic link" in got.err and "not a mark hpcdist wrote" in got.err
    assert "-1-e.mark.json (owner bob, mode 0640): not a regular file of at most 16384 bytes" in got.err


def test_a_group_writable_storage_mode_is_refused_in_one_line() -> None:
    require_members()
    got = as_user("bob", "-m", "hpcdist.cli", "render", str(REPO / "jobs" / "smoke.yaml"), "--site", "local-group",
                  "--set", "site.storage.mode=0660")
    assert got.code != 0 and len(got.err.strip().splitlines()) == 1, got.text
    assert "0660 lets the group write" in got.err


def test_the_snapshot_leaves_secret_names_out_and_is_the_users_alone(tmp_path: Path) -> None:
    from hpcdist.files.atomic import storage_umask
    from hpcdist.kinds import snapshot

    src = tmp_path / "code"
    (src / "private").mkdir(parents=True)
    secrets = ["mytoken.txt", "dbpassword.txt", "AccessToken.txt", "mysecret.yaml", ".envrc"]
    for name in [*secrets, "train.py", "tokenizer.py", "tokenizer.json", "notes.txt"]:
        (src / name).write_text("x")
    (src / "private" / "model.py").write_text("x")
    (src / "private" / "model.py").chmod(0o644)
    (src / "private").chmod(0o700)
    with storage_umask(0o027):  # storage.mode 0640: folders 0750
        dest, left_out = snapshot.make(src, tmp_path / "snap", "", 10)
    assert sorted(str(p) for p in left_out) == sorted(secrets)
    kept = ["notes.txt", "private", "tokenizer.json", "tokenizer.py", "train.py"]
    assert sorted(p.name for p in dest.iterdir()) == kept
    assert _mode(dest) == _mode(dest / "private") == 0o700  # the user's alone, whatever storage.mode says
    assert _mode(dest / "private" / "model.py") == _mode(dest / "train.py") == 0o600


def test_checkpoints_at_the_place_of_earlier_builds_are_found_there(tmp_path: Path) -> None:
    from hpcdist.config import load_site
    from hpcdist.config.paths import JobPaths
    from hpcdist.files.trust import current_user

    roots = {key: tmp_path / key for key in ("results", "checkpoints", "scratch", "logs")}
    for root in roots.values():
        root.mkdir()
        root.chmod(0o3777)  # a root others may write: one folder per user
    site = load_site("local-group", [f"storage.{key}={root}" for key, root in roots.items()])
    old = roots["checkpoints"] / "train_gpt"
    assert JobPaths(site.storage, "train_gpt").checkpoints == roots["checkpoints"] / current_user() / "train_gpt"
    old.mkdir()  # a job that checkpointed before per-user folders: pending or requeued across the upgrade
    assert JobPaths(site.storage, "train_gpt").checkpoints == old
    (roots["checkpoints"] / current_user() / "train_gpt").mkdir(parents=True)  # moved: the new place wins
    assert JobPaths(site.storage, "train_gpt").checkpoints == roots["checkpoints"] / current_user() / "train_gpt"
    assert JobPaths(site.storage, "train_gpt").result().parent == roots["results"] / current_user() / "train_gpt"


@pytest.mark.slurm
def test_everyday_commands_as_a_member_and_the_other_member_is_refused_hers(tag: str) -> None:
    """submit, stacks, jobs, logs, nodes, cancel and wait as alice on a running job of hers; bob's
    stacks and cancel of that job are refused in one line and the job runs on until alice cancels."""
    from tests.support.cli import require_slurm

    require_slurm()
    require_members()
    cli = ("-m", "hpcdist.cli")
    code = Path(f"/home/alice/t-{uuid.uuid4().hex[:6]}")  # her own script, in a folder of hers
    code.mkdir()
    hang = code / "hang.py"
    shutil.copyfile(REPO / "tests" / "scripts" / "hang.py", hang)
    shutil.chown(code, "alice", "alice")
    shutil.chown(hang, "alice", "alice")
    submitted = as_user("alice", *cli, "submit", "--site", "local-group", "--set", "timeout_s=60",
                        "--set", f"name=hang-{tag}", "--", str(hang), "120", umask="002")
    assert submitted.code == 0, submitted.text
    jid = job_id(submitted.out)
    try:
        seen = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # alice asks for her ranks' stacks until they hang where the script does
            got = as_user("alice", *cli, "stacks", jid, "--json", timeout=60)
            seen = json.loads(got.out) if got.code == 0 else None
            if seen and any("time.sleep(600)" in g["where"] for g in seen["groups"]):
                break
            time.sleep(1)
        assert seen is not None and any("time.sleep(600)" in g["where"] for g in seen["groups"]), seen
        for command in ("stacks", "cancel"):
            refused = as_user("bob", *cli, command, jid)
            assert refused.code != 0 and refused.err.strip() == refused.err.strip().splitlines()[0], refused.text
            assert f"job {jid} is alice's, not yours" in refused.err
        assert as_user("alice", *cli, "jobs").out.count(jid) >= 1
        assert as_user("alice", *cli, "logs", jid).code == 0
        # the node-health record is the group's: bob's mark is alice's to read and to clear
        node = ("nodes", "--site", "local-group")
        assert as_user("bob", *cli, *node, "--mark", "n4", "--reason", "shared-site test", umask="077").code == 0
        try:
            listed = json.loads(as_user("alice", *cli, *node, "--json").out)
            assert [(n["node"], [m["user"] for m in n["marks"]]) for n in listed["nodes"]] == [("n4", ["bob"])], listed
        finally:
            cleared = as_user("alice", *cli, *node, "--clear", "n4")
        assert cleared.code == 0, cleared.text
        assert json.loads(as_user("bob", *cli, *node, "--json").out)["nodes"] == []
    finally:
        cancelled = as_user("alice", *cli, "cancel", jid)
    assert cancelled.code == 0, cancelled.text
    waited = as_user("alice", *cli, "wait", jid, timeout=120)
    shutil.rmtree(code)
    assert "CANCELLED" in waited.text, waited.text


@pytest.mark.slurm
def test_roots_the_first_member_made_her_own_tell_the_second_what_the_admin_must_do() -> None:
    """The issue's site: alice's first submit (an earlier build) made the roots hers, 2750. bob's
    submit fails before anything is queued, in one line naming the folder, its owner and mode and
    the admin's recipe."""
    from tests.support.cli import require_slurm

    require_slurm()
    require_members()
    old = GROUP_ROOT / "scratch" / f"t-old-{uuid.uuid4().hex[:6]}"
    try:
        for key in ("results", "checkpoints", "scratch", "logs"):
            (old / key).mkdir(parents=True)
            shutil.chown(old / key, "alice", "mlgroup")
            (old / key).chmod(0o2750)
        sets = [a for key in ("results", "checkpoints", "scratch", "logs")
                for a in ("--set", f"site.storage.{key}={old / key}")]
        got = as_user("bob", "-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "smoke.yaml"), "--site", "local-group",
                      *sets)
        assert got.code != 0 and len(got.err.strip().splitlines()) == 1, got.text
        assert "owner alice, mode 2750) is not yours to write" in got.err, got.err
        assert "chmod 3770 ROOT" in got.err
    finally:
        shutil.rmtree(old, ignore_errors=True)


def test_a_code_snapshot_another_member_could_write_is_not_run(group_folder: Path) -> None:
    marker = group_folder / "ran"
    plant = ("import os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
             "open(os.path.join(sys.argv[1], 'train.py'), 'w').write(f'open({sys.argv[2]!r}, \"w\")')")
    assert as_user("bob", "-c", plant, str(group_folder / "code"), str(marker), umask="002").code == 0
    run = ("import sys; from hpcdist.kinds.python import PythonParams\n"
           "from hpcdist.kinds.python_run import _run_target\n"
           "try:\n    _run_target(PythonParams(script=sys.argv[1] + '/train.py', code_dir=sys.argv[1]))\n"
           "except Exception as exc:\n    print(exc)\n")
    refused = as_user("alice", "-c", run, str(group_folder / "code"))
    assert "refusing to read" in refused.out and "owner bob" in refused.out, refused.text
    assert not marker.exists()


@pytest.mark.slurm
def test_a_member_starts_from_a_colleagues_checkpoint_read_only(tag: str) -> None:
    """bob's training starts from alice's checkpoint named by path (params.init): it reads hers,
    writes only his own, and her folder is as she left it."""
    from tests.support.cli import require_slurm, run_cli
    from tests.support.train import TINY, write_corpus

    require_slurm()
    require_members()
    data = GROUP_ROOT / f"t-data-{tag}"  # the group's data, made by the admin: readable by members
    data.mkdir()
    data.chmod(0o755)
    try:
        corpus = write_corpus(data / "corpus.txt", words=3000)
        tokens = data / "tokens.h5"
        assert run_cli("data", "prepare", str(corpus), "-o", str(tokens)).code == 0
        tokens.chmod(0o644)
        name = f"tg-{tag}"
        train = ("-m", "hpcdist.cli", "submit", str(REPO / "jobs" / "train_gpt.yaml"), "--site", "local-group",
                 "--wait", "--set", f"name={name}", "--set", f"params.data={tokens}", *TINY,
                 "--set", "params.steps=20", "--set", "params.checkpoint.every=10", "--set", "params.eval.every=10")
        first = as_user("alice", *train, umask="002")
        assert first.code == 0, first.text
        hers = GROUP_ROOT / "checkpoints" / "alice" / name
        before = {p.name: p.stat().st_mtime_ns for p in hers.iterdir()}
        second = as_user("bob", *train, "--set", f"params.init={hers}", umask="077")
        assert second.code == 0, second.text
        assert {p.name: p.stat().st_mtime_ns for p in hers.iterdir()} == before  # hers: read, never written
        assert (GROUP_ROOT / "checkpoints" / "bob" / name / "step_00000020.h5").owner() == "bob"
        log = "".join(p.read_text() for p in (GROUP_ROOT / "logs" / "bob" / name).glob("*/train_rank0.log"))
        assert f"starting from the weights of {hers / 'step_00000020.h5'} (params.init)" in log, log[-2000:]
    finally:
        shutil.rmtree(data, ignore_errors=True)

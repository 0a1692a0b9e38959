"""What a member leaves in a folder another member submits from, and what a submit leaves for the
group to read (issue 54, items 1, 2, 5, 6 and 7), run as the test bed's ordinary users: bob plants,
alice is the victim, through the `hpcdist` command she types and `hpcdist.Executor`. The local
site only; her storage lies in the group root, whose folders the group may enter (0750)."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import REPO, Run
from tests.support.members import GROUP_ROOT, USERS_VENV, as_user, require_members, run_as

HOOK = REPO / "tests" / "scripts" / "snapshot_hook"
READ = "import sys; print(len(open(sys.argv[1], 'rb').read()))"


def hpcdist(user: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> Run:
    """The `hpcdist` command as `user` types it (the venv's entry script: this checkout first)."""
    return run_as(user, str(USERS_VENV / "bin" / "hpcdist"), *args, cwd=cwd,
                  env={"PYTHONPATH": str(REPO), **(env or {})})


@dataclass
class Place:
    shared: Path  # bob's folder in the group root, 2770: a project folder the group writes
    home: Path  # a folder of alice's under her 0700 home
    code: Path  # her code there (0755), its files 0644: only the home keeps the group out
    store: Path  # her storage roots, made by her command in the group root
    sets: list[str]


@pytest.fixture
def place() -> Iterator[Place]:
    require_members()
    tag = uuid.uuid4().hex[:8]
    shared = GROUP_ROOT / "scratch" / f"t-proj-{tag}"
    home, store = Path(f"/home/alice/t-{tag}"), GROUP_ROOT / "scratch" / f"t-store-{tag}"
    try:
        shared.mkdir()
        shutil.chown(shared, "bob", "mlgroup")
        shared.chmod(0o2770)
        code = home / "code"
        code.mkdir(parents=True)
        (code / "train.py").write_text("import colorsys, mymodule\nprint('ran', mymodule.X, colorsys.__file__)\n")
        (code / "mymodule.py").write_text("X = 7\n")
        for path in (home, code, *code.iterdir()):
            shutil.chown(path, "alice", "alice")
        home.chmod(0o700)
        sets = [a for key in ("results", "checkpoints", "scratch", "logs")
                for a in ("--set", f"site.storage.{key}={store / key}")]
        yield Place(shared, home, code, store, sets)
    finally:
        for folder in (shared, home, store, store.parent / f"{store.name}-fifos"):
            shutil.rmtree(folder, ignore_errors=True)


PLANT = """
import os, sys
marker, folder = sys.argv[1], sys.argv[2]
line = "import os; open({!r}, 'a').write('{} ran as ' + str(os.getuid()) + chr(10))\\n"
os.makedirs(os.path.join(folder, "hpcdist"))
for name, path in (("json", "json.py"), ("colorsys", "colorsys.py"), ("hpcdist", "hpcdist/__init__.py")):
    open(os.path.join(folder, path), "w").write(line.format(marker, name))
"""


def test_modules_a_member_plants_in_the_submit_folder_are_never_imported(place: Place) -> None:
    """Item 1: bob's json.py, colorsys.py and hpcdist/ in the group folder alice submits from ran as
    her in submit's import check, the local controller and her rank. Now no Python hpcdist starts
    has that folder first on its path (-P), her script's import of colorsys is the standard
    library's, and mymodule beside her script comes from the snapshot; submit says in one line that
    the folder is left off the path."""
    marker = place.shared / "ran"
    assert as_user("bob", "-c", PLANT, str(marker), str(place.shared), umask="002").code == 0
    got = hpcdist("alice", "submit", "--site", "local", *place.sets, "--wait", "--", str(place.code / "train.py"),
                  cwd=place.shared)
    assert not marker.exists(), marker.read_text() + got.text
    assert got.code == 0 and "1/1 ranks succeeded" in got.out, got.text
    said = [line for line in got.err.splitlines() if str(place.shared) in line]
    assert len(said) == 1 and f"{place.shared} (owner bob, mode 2770)" in said[0], got.err
    assert "the job imports nothing from it" in said[0], said
    logs = "".join(p.read_text() for p in (place.store / "logs").rglob("*_0_log.out"))
    assert "ran 7 /usr/lib/python3" in logs, logs


def test_a_module_found_only_in_a_folder_others_write_is_one_error_at_submit(place: Place) -> None:
    """Item 1, `-m`: alice's `-m pkg.train` in the group folder is found nowhere else, and the
    folder is not searched (bob could have put pkg/ there): one line saying why and what to do."""
    plant = ("import os, sys; os.makedirs(sys.argv[1] + '/pkg'); open(sys.argv[1] + '/pkg/__init__.py', 'w'); "
             "open(sys.argv[1] + '/pkg/train.py', 'w').write('print(1)')")
    assert as_user("alice", "-c", plant, str(place.shared), umask="002").code == 0
    got = hpcdist("alice", "render", "--site", "local", *place.sets, "--", "-m", "pkg.train", cwd=place.shared)
    assert got.code == 2 and len(got.err.strip().splitlines()) == 1, got.text
    assert f"the current folder is not searched: {place.shared} (owner bob, mode 2770) belongs to another user" \
        in got.err and "submit from a folder of your own" in got.err, got.err


SITE = ("name: local\nscheduler: local\npartitions: {local: {nodes: 1, cpus_per_node: 4}}\nlauncher: {kind: local}\n"
        "storage: {results: out/results, checkpoints: out/checkpoints, scratch: out/scratch, logs: out/logs}\n")


def test_a_site_config_in_a_folder_others_write_is_refused_and_her_own_is_named(place: Place) -> None:
    """Item 2: bob's site_configs/local.yaml in the group folder ran its setup: line as alice for
    the default site and for --site local. Now it is refused in one line naming it, its owner and
    mode, and nothing runs; her own in a folder of hers is used, said in one line."""
    marker = place.shared / "ran"
    plant = ("import os, sys; os.makedirs(sys.argv[1] + '/site_configs'); "
             "open(sys.argv[1] + '/site_configs/local.yaml', 'w').write(sys.argv[2])")
    planted = SITE + f"setup: ['touch {marker}']\n"
    assert as_user("bob", "-c", plant, str(place.shared), planted, umask="002").code == 0
    for site in ([], ["--site", "local"]):
        got = hpcdist("alice", "submit", *site, *place.sets, "--", str(place.code / "train.py"), cwd=place.shared)
        assert got.code == 2 and len(got.err.strip().splitlines()) == 1, got.text
        assert f"{place.shared}/site_configs/local.yaml (owner bob, mode 0664)" in got.err, got.err
        assert not marker.exists()
    mine = place.code / "site_configs"
    assert run_as("alice", "mkdir", str(mine)).code == 0
    assert as_user("alice", "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", str(mine / "local.yaml"),
                   SITE).code == 0
    got = hpcdist("alice", "render", "--site", "local", "--", "train.py", cwd=place.code)
    assert got.code == 0, got.text
    assert got.err.count("shadows") == 1 and f"site 'local' is {mine / 'local.yaml'}" in got.err, got.err


CALL = """
import sys, hpcdist
def echo(secret):
    return len(secret)
roots = {f"site.storage.{k}": f"{sys.argv[1]}/{k}" for k in ("results", "checkpoints", "scratch", "logs")}
job = hpcdist.Executor(site="local", name="echo", set=roots).submit(echo, "SECRET-123")
print(job.result(timeout_s=120))
print(job.paths.submitted_pickle)
"""


def test_a_direct_executor_calls_pickle_is_hers_alone(place: Place) -> None:
    """Item 6: the pickle of alice's direct Executor call, which holds its arguments, was 0640 in
    a folder the group enters, and bob read 'SECRET-123' from it. Now it is 0600, as the result."""
    got = as_user("alice", "-c", CALL, str(place.store), cwd=place.code)
    assert got.code == 0, got.text
    count, pickle = got.out.strip().splitlines()[-2:]
    assert count == "10"
    assert oct(os.stat(pickle).st_mode & 0o777) == "0o600"
    assert {oct(p.stat().st_mode & 0o777) for p in Path(pickle).parent.glob("*_result.pkl")} == {"0o600"}
    read = as_user("bob", "-c", READ, pickle)
    assert read.code != 0 and "Permission denied" in read.err, read.text


def test_the_snapshot_copies_no_link_swapped_in_and_is_hers_alone(place: Place) -> None:
    """Item 7: alice submits bob's script in the group folder; between the snapshot's listing and
    its copy bob swaps notes.txt for a link to her token, which landed in the snapshot. Now the
    copy opens no link, and the submit stops in one line naming the file. And her own code, kept
    from the group by her 0700 home only, became group-readable in the snapshot: now 0700/0600."""
    token = place.home / "hf" / "token"
    token.parent.mkdir(mode=0o700)
    token.write_text("hf_TOKEN_OF_ALICE")
    token.chmod(0o600)
    for path in (token.parent, token):
        shutil.chown(path, "alice", "alice")
    plant = ("import sys; open(sys.argv[1] + '/train.py', 'w').write('print(1)'); "
             "open(sys.argv[1] + '/notes.txt', 'w').write('notes')")
    assert as_user("bob", "-c", plant, str(place.shared), umask="002").code == 0
    fifos = place.store.parent / f"{place.store.name}-fifos"  # where alice and the test reach
    fifos.mkdir()
    fifos.chmod(0o777)
    go, done = fifos / "go", fifos / "done"
    for fifo in (go, done):
        os.mkfifo(fifo)
        fifo.chmod(0o666)
    swap = ("import os, sys; os.symlink(sys.argv[1], sys.argv[2] + '.new'); "
            "os.rename(sys.argv[2] + '.new', sys.argv[2])")
    swapped: list[Run] = []

    def attacker() -> None:
        with open(go) as f:
            f.read()
        swapped.append(as_user("bob", "-c", swap, str(token), str(place.shared / "notes.txt")))
        with open(done, "w") as f:
            f.write("ok")

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    env = {"PYTHONPATH": f"{HOOK}:{REPO}", "HPCDIST_TEST_SNAPSHOT_GO": str(go), "HPCDIST_TEST_SNAPSHOT_DONE": str(done)}
    got = run_as("alice", str(USERS_VENV / "bin" / "hpcdist"), "submit", "--site", "local", *place.sets, "--wait",
                 "--", str(place.shared / "train.py"), cwd=place.home, env=env)
    thread.join(10)
    assert swapped and swapped[0].code == 0, (swapped, got.text)
    copied = [p for p in (place.store / "logs").rglob("*") if p.is_file() and b"hf_TOKEN" in p.read_bytes()]
    assert not copied, copied
    assert got.code == 2 and len(got.err.strip().splitlines()) == 1, got.text
    assert f"{place.shared / 'notes.txt'}" in got.err and "a link" in got.err, got.err

    mine = hpcdist("alice", "submit", "--site", "local", *place.sets, "--wait", "--", str(place.code / "train.py"),
                   cwd=place.home)
    assert mine.code == 0 and "1/1 ranks succeeded" in mine.out, mine.text
    (snap,) = (place.store / "logs" / "train").glob("code-*")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (snap, *snap.glob("*.py"))}  # (and the rank's __pycache__)
    assert modes == {snap.name: "0o700", "train.py": "0o600", "mymodule.py": "0o600"}, modes
    read = as_user("bob", "-c", READ, str(snap / "train.py"))
    assert read.code != 0 and "Permission denied" in read.err, read.text


DENIED = """
import sys, hpcdist
from hpcdist.errors import HpcdistError
roots = {f"site.storage.{k}": f"{sys.argv[1]}/{k}" for k in ("results", "checkpoints", "scratch", "logs")}
try:
    hpcdist.Executor(site="local", name="echo", set=roots).submit(len, "x")
except HpcdistError as exc:
    print(type(exc).__name__, exc)
"""


def test_an_executor_call_on_storage_that_is_not_hers_is_one_error_naming_whose(place: Place) -> None:
    """A storage root the admin made their own (root, 0755) and never opened to the group: alice's
    `hpcdist.Executor` call ended in a raw PermissionError from deep in pathlib (issue 54, found on
    the way; issue 55's first finding); now the error `hpcdist submit` gives: whose folder, what
    the admin runs."""
    root = place.store.parent / f"{place.store.name}-admins"
    root.mkdir()
    root.chmod(0o755)  # not the group root's setgid either
    try:
        got = as_user("alice", "-c", DENIED, str(root), cwd=place.code)
        assert got.code == 0 and "Traceback" not in got.err, got.text
        assert got.out.strip() == (  # (issue 68: the root, its owner and mode, and the key to set)
            f"StorageDenied site local: storage.results: {root}/results does not exist and cannot be made: {root} "
            f"(owner root, mode 0755) is not yours to write; set site.storage.results to a folder of yours (--set "
            f"site.storage.results=DIR, set={{'site.storage.results': DIR}} in Python, or in your copy of the site), "
            f"or write a site of your own with `hpcdist site init` (a root a group shares is made by the site's "
            f"admin: chgrp GROUP ROOT; chmod 3770 ROOT)"), got.out
    finally:
        shutil.rmtree(root)


def _her_store(place: Place) -> list[str]:
    """alice's real storage folder (hers, 0750, in the group root) and the --set of each root
    under `<link>/`, the link named by the caller."""
    assert run_as("alice", "mkdir", "-m", "0750", str(place.store)).code == 0
    keys = ("results", "checkpoints", "scratch", "logs")
    return [a for key in keys for a in ("--set", f"site.storage.{key}={{}}/{key}")]


@pytest.mark.parametrize("maker", ["bob", "alice"])
def test_storage_through_a_link_a_member_can_repoint_is_refused_at_submit(place: Place, maker: str) -> None:
    """Item 5: alice's storage reached through `hpc -> <her folder>` in bob's 2770 project folder.
    The link was followed unchecked: bob repointed it under her running job and her rank's next
    import loaded his copy. Now, whoever made the link, her submit is one line naming it, its
    owner and mode and its folder, and the real path to use; nothing is written or run."""
    sets = _her_store(place)
    link = place.shared / "hpc"
    assert run_as(maker, "ln", "-s", str(place.store), str(link)).code == 0
    got = hpcdist("alice", "submit", "--site", "local", *[s.format(link) for s in sets], "--wait", "--",
                  str(place.code / "train.py"), cwd=place.home)
    assert got.code == 2 and "Traceback" not in got.err and len(got.err.strip().splitlines()) == 1, got.text
    assert f"{link} (owner {maker}, mode 0777, a symbolic link) -> {place.store}" in got.err, got.err
    why = "the link belongs to bob" if maker == "bob" else f"its folder {place.shared} (owner bob, mode 2770)"
    assert why in got.err, got.err
    assert f"name the real path ({place.store}/" in got.err, got.err
    assert list(place.store.iterdir()) == [], "nothing of the job was made through the link"


SLEEPER = """
import os, sys, time
go = sys.argv[1]
open(go + ".started", "w").close()
while not os.path.exists(go):
    time.sleep(0.05)
import later
print("LATER", later.WHO, later.__file__, flush=True)
while not os.path.exists(go + "2"):
    time.sleep(0.05)
"""


def test_a_link_of_her_own_is_followed_and_the_ranks_import_from_the_real_path(place: Place) -> None:
    """Item 5: a link of alice's in a folder only she writes (her home) is accepted, and the
    snapshot her rank imports from is the real path read at submit: the link repointed while the
    job runs (by her, or the admin: no one else can) changes nothing of what the rank imports."""
    sets = _her_store(place)
    link, other = place.home / "hpc", place.store.parent / f"{place.store.name}-other"
    assert run_as("alice", "ln", "-s", str(place.store), str(link)).code == 0
    (place.code / "train.py").write_text(SLEEPER)
    (place.code / "later.py").write_text("WHO = 'submitted'\n")
    shutil.chown(place.code / "later.py", "alice", "alice")
    signals = place.store.parent / f"{place.store.name}-fifos"  # removed by the fixture
    signals.mkdir()
    signals.chmod(0o777)
    go = signals / "go"
    runs: list[Run] = []
    job = threading.Thread(target=lambda: runs.append(hpcdist(
        "alice", "submit", "--site", "local", *[s.format(link) for s in sets], "--wait", "--",
        str(place.code / "train.py"), str(go), cwd=place.home)), daemon=True)
    job.start()
    for _ in range(600):
        if (signals / "go.started").exists() or not job.is_alive():
            break
        threading.Event().wait(0.05)
    assert (signals / "go.started").exists(), runs
    (snap,) = (place.store / "logs" / "train").glob("code-*")
    (log,) = (place.store / "logs" / "train").rglob("*_0_log.out")  # opened before the repoint
    copy = other / "logs" / "train" / snap.name
    try:
        copy.mkdir(parents=True)
        (copy / "later.py").write_text("WHO = 'repointed'\n")
        link.unlink()
        link.symlink_to(other)
        go.touch()
        for _ in range(600):
            if "LATER" in log.read_text() or not job.is_alive():
                break
            threading.Event().wait(0.05)
    finally:  # the link back for the rest of the job: the storage, unlike the code, is named through it
        link.unlink()
        link.symlink_to(place.store)
        (signals / "go2").touch()
        job.join(120)
        shutil.rmtree(other, ignore_errors=True)
    assert runs and runs[0].code == 0 and "1/1 ranks succeeded" in runs[0].out, runs
    logs = "".join(p.read_text() for p in (place.store / "logs").rglob("*_0_log.out"))
    assert f"LATER submitted {snap}/later.py" in logs, logs

"""A colleague cannot poison a member's checkpoints (issue 41, item 5): alice's resume, through the
front door (``hpcdist.init()`` and ``ctx.checkpoints.load_latest()``, run as alice), never loads
weights bob could have written. bob's copy of his own run put in place of her checkpoint folder is
refused in one line naming it and its owner; a step file and a ``latest`` pointer of his inside
her own folder are skipped, each named in a warning, and her newest own step is loaded; a swap of
the folder between the check and the read, made at that very moment (the script blocks on a FIFO
right after the folder was opened, while the harness swaps it), changes nothing. Root only sets
up, swaps and cleans up: every load runs as the ordinary member."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO
from tests.support.members import GROUP_ROOT, as_user, finish, require_members, spawn

CHECKPOINTS = GROUP_ROOT / "checkpoints"

# A member's script: `save NAME BASE LAST [sharded]` commits steps 1..LAST of a tiny state, w = BASE + step;
# `load NAME [GO DONE]` prints what load_latest gives (or its one-line error). With GO and DONE, two
# FIFOs, it stops right after the checkpoint folder was listed (so, opened) until the harness says
# it swapped the folder.
SCRIPT = """
import json, sys
import torch
import hpcdist
from hpcdist.errors import HpcdistError

action, name = sys.argv[1], sys.argv[2]
ctx = hpcdist.init(site="local-group", name=name)
if action == "save":
    base, last, sharded = float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["sharded"]
    for step in range(1, last + 1):
        ctx.checkpoints.save(step, {"w": torch.full((64,), base + step)}, sharded=sharded)
    print(json.dumps({"saved": str(ctx.checkpoints.directory)}))
    sys.exit(0)
if len(sys.argv) > 3:
    from hpcdist.store.checkpoint import discovery

    listed, hooked = discovery.checkpoints_in, []

    def listing(directory):
        files = listed(directory)
        if not hooked:
            hooked.append(1)
            with open(sys.argv[3], "w") as go:
                go.write("listed\\n")
            with open(sys.argv[4]) as done:
                done.read()
        return files

    discovery.checkpoints_in = listing
try:
    got = ctx.checkpoints.load_latest()
except HpcdistError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"loaded": None if got is None else [got[0], float(got[1]["w"][0])]}))
"""

ALICE_BASE, BOB_BASE = 0.5, 100.0  # alice's step 2 holds 2.5; bob's steps hold 101, 102, 103


def _run(user: str, *args: str) -> dict[str, object]:
    run = as_user(user, "-c", SCRIPT, *args, timeout=120)
    assert run.code == 0, run.text
    return dict(json.loads(run.out.strip().splitlines()[-1]))


def _copy(src: Path, dest: Path) -> None:
    """As root: `src` copied with its owners and modes (an admin's `cp -a`, or a member's own copy)."""
    subprocess.run(["cp", "-a", str(src), str(dest)], check=True)


@pytest.fixture(scope="module")
def runs() -> Iterator[tuple[str, Path, Path]]:
    """alice's committed steps 1-2 and bob's 1-3 of a job of the same name, each in their own
    folder; the tag of this module's names."""
    require_members()
    tag = uuid.uuid4().hex[:6]
    name = f"ck-{tag}"
    try:
        hers = Path(str(_run("alice", "save", name, str(ALICE_BASE), "2")["saved"]))
        his = Path(str(_run("bob", "save", name, str(BOB_BASE), "3")["saved"]))
        assert (hers, his) == (CHECKPOINTS / "alice" / name, CHECKPOINTS / "bob" / name)
        assert hers.owner() == "alice" and his.owner() == "bob"
        yield tag, hers, his
    finally:
        for folder in GROUP_ROOT.glob(f"*/*/*{tag}*"):
            shutil.rmtree(folder, ignore_errors=True)


def _fresh(runs: tuple[str, Path, Path], label: str) -> tuple[str, Path]:
    """A job name of alice's whose folder is a copy of her committed run (hers: her owner and modes)."""
    tag, hers, _ = runs
    name = f"{label}-{tag}"
    _copy(hers, CHECKPOINTS / "alice" / name)
    return name, CHECKPOINTS / "alice" / name


def test_a_colleagues_copy_put_in_place_of_her_checkpoint_folder_is_refused(runs: tuple[str, Path, Path]) -> None:
    """bob moves alice's folder aside and puts a copy of his own run there, group-writable so that
    her run can claim it: her resume refuses it in one line naming it, its owner and what to do,
    and loads nothing (today it resumed bob's step 3)."""
    _, _, his = runs
    name, folder = _fresh(runs, "swapped")
    folder.rename(folder.with_name(f".aside-{name}"))
    _copy(his, folder)
    folder.chmod(0o2770)
    got = _run("alice", "load", name)
    assert "loaded" not in got, got
    error = str(got["error"])
    assert error.startswith(f"refusing checkpoint folder {folder}: "), error
    assert "(owner bob, mode 2770)" in error and "nothing was loaded" in error, error
    assert f"mv {folder} {folder}.bob" in error and "params.init" in error, error
    assert "\n" not in error


def test_a_colleagues_step_and_pointer_inside_her_own_folder_are_skipped(runs: tuple[str, Path, Path]) -> None:
    """A newer step file of bob's and his ``latest`` naming it, put in alice's own folder (by an
    admin's copy, or while it was open to the group): each is skipped with one warning naming it,
    and alice resumes her own newest step, 2 (today: bob's step 3)."""
    _, _, his = runs
    name, folder = _fresh(runs, "planted")
    for file in ("step_00000003.h5", "latest"):
        _copy(his / file, folder / file)
        assert (folder / file).owner() == "bob"
    run = as_user("alice", "-c", SCRIPT, "load", name, timeout=120)
    assert run.code == 0, run.text
    assert json.loads(run.out.strip().splitlines()[-1]) == {"loaded": [2, ALICE_BASE + 2]}, run.text
    warned = [line for line in run.err.splitlines() if " WARNING " in line]
    assert any(f"skipping checkpoint {folder / 'step_00000003.h5'}: owner bob, mode 0640: bob's, not yours"
               in line for line in warned), run.err
    assert any(f"checkpoint pointer: ignoring {folder / 'latest'}: owner bob" in line for line in warned), run.err


def test_a_sharded_step_whose_shard_folder_is_a_colleagues_is_skipped(runs: tuple[str, Path, Path]) -> None:
    """alice's newest sharded step with a shard folder of bob's (its index hers): skipped with one
    warning naming it, and her step 1 is loaded, its shards read through her checked folder
    (today: step 2, whatever bob put in its shards)."""
    tag = runs[0]
    name = f"sharded-{tag}"
    folder = Path(str(_run("alice", "save", name, str(ALICE_BASE), "2", "sharded")["saved"]))
    shards = folder / "step_00000002.shards"
    assert shards.is_dir() and shards.owner() == "alice"
    subprocess.run(["chown", "-R", "bob", str(shards)], check=True)
    run = as_user("alice", "-c", SCRIPT, "load", name, timeout=120)
    assert run.code == 0, run.text
    assert json.loads(run.out.strip().splitlines()[-1]) == {"loaded": [1, ALICE_BASE + 1]}, run.text
    assert (f"skipping checkpoint {folder / 'step_00000002.h5'}: its shard folder step_00000002.shards: owner bob"
            in run.err), run.err


@pytest.fixture
def fifos() -> Iterator[tuple[Path, Path]]:
    """Two FIFOs alice may open: `go` (she says the folder is open) and `done` (root swapped it)."""
    top = Path(f"/tmp/hpcdist-t-{uuid.uuid4().hex[:8]}")
    top.mkdir(mode=0o755)
    go, done = top / "go", top / "done"
    for fifo in (go, done):
        os.mkfifo(fifo)
        fifo.chmod(0o666)
    yield go, done
    shutil.rmtree(top, ignore_errors=True)


def _await(fd: int, proc: subprocess.Popen[str], timeout: float = 60) -> bytes:
    """What arrives on the FIFO `fd` (opened O_NONBLOCK), or b"" if `proc` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([fd], [], [], 0.1)
        data = os.read(fd, 64) if ready else b""
        if data:
            return data
    return b""


def _answer(path: Path, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """Open the FIFO `path` for writing once `proc` opened it for reading, and write one line."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:  # ENXIO: no reader yet
            assert time.monotonic() < deadline and proc.poll() is None, "the member's script never waited"
            time.sleep(0.01)
    os.write(fd, b"swapped\n")
    os.close(fd)


def test_a_swap_of_her_folder_between_the_check_and_the_read_changes_nothing(
        runs: tuple[str, Path, Path], fifos: tuple[Path, Path]) -> None:
    """Right after alice's resume opened her checkpoint folder, root (as bob would with a rename
    of his folder) moves it aside and puts bob's run in its place, then lets her go on: the
    checkpoint she loads is her own (step 2), read through the folder that was checked, not bob's
    (today: his step 3)."""
    _, _, his = runs
    name, folder = _fresh(runs, "raced")
    twin = folder.with_name(f".twin-{name}")
    _copy(his, twin)
    go, done = fifos
    reader = os.open(go, os.O_RDONLY | os.O_NONBLOCK)
    try:
        proc = spawn("alice", "-c", SCRIPT, "load", name, str(go), str(done))
        try:
            assert _await(reader, proc) == b"listed\n", finish(proc, 10).text
            folder.rename(folder.with_name(f".real-{name}"))
            twin.rename(folder)
            _answer(done, proc)
            run = finish(proc, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        os.close(reader)
    assert run.code == 0, run.text
    assert folder.owner() == "bob"  # the swap happened: the path now names bob's run
    assert json.loads(run.out.strip().splitlines()[-1]) == {"loaded": [2, ALICE_BASE + 2]}, run.text


@pytest.fixture
def project() -> Iterator[Path]:
    """alice's working folder (the local site's hpcdist-out/ goes there) holding a project folder
    everyone may write (bob's, 0777), where alice keeps her infer_gpt spec and prompts."""
    require_members()
    top = Path(f"/tmp/hpcdist-t-{uuid.uuid4().hex[:8]}")
    top.mkdir(mode=0o755)
    shutil.chown(top, "alice")
    try:
        shared = top / "project"
        shared.mkdir()
        shared.chmod(0o777)
        shutil.chown(shared, "bob", "bob")
        spec = (REPO / "jobs" / "infer_gpt.yaml").read_text()
        for name, text in (("infer.yaml", spec), ("prompts.txt", "Hello\n")):
            (shared / name).write_text(text)
            shutil.chown(shared / name, "alice", "alice")
        yield shared
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _checkpoint(folder: Path, owner: str, seed: int) -> None:
    """A tiny model's checkpoint of `owner`'s in `folder` (and the folders made for it below /tmp/hpcdist-t-*)."""
    from tests.support.infer import make_checkpoint

    make_checkpoint(folder, seed=seed)
    top = folder.parents[len(folder.parents) - 3]
    for path in (*[p for p in folder.parents if p.is_relative_to(top) and p != top], folder, *folder.rglob("*")):
        shutil.chown(path, owner, owner)


def test_a_relative_checkpoint_beside_a_spec_in_a_folder_others_write_is_not_loaded(project: Path) -> None:
    """bob's train_gpt/ beside alice's infer.yaml in a folder he may write (before: her job generated
    from it, even with her own <checkpoints>/train_gpt there, and without a word)."""
    top = project.parent
    _checkpoint(project / "train_gpt", "bob", seed=1)
    submit = ("-m", "hpcdist.cli", "submit", str(project / "infer.yaml"), "--site", "local",
              "--set", "resources.tasks_per_node=1", "--set", "params.tp=1", "--set", "params.max_new_tokens=2")
    mine = top / "hpcdist-out" / "checkpoints" / "train_gpt"
    refused = as_user("alice", *submit, cwd=top)
    assert refused.code == 2 and f"{mine}" in refused.err, refused.text  # not there: nothing of bob's instead
    assert f"not {project / 'train_gpt'}: {project} (owner bob, mode 0777) belongs to another user" in refused.err
    assert not (top / "hpcdist-out" / "results").exists()

    _checkpoint(mine, "alice", seed=2)
    ran = as_user("alice", *submit, "--wait", cwd=top)
    assert ran.code == 0 and "1/1 ranks succeeded" in ran.out, ran.text
    assert ran.err.count(f"params.checkpoint: 'train_gpt' is {mine}, not {project / 'train_gpt'}") == 1, ran.err
    from hpcdist.store.results import read_attrs

    (result,) = (top / "hpcdist-out" / "results" / "infer_gpt").glob("*.h5")
    assert Path(read_attrs(result)["checkpoint"]).is_relative_to(mine)

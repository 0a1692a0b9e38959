"""Asynchronous checkpoint saves (`CheckpointStore.save_async`): the state is copied before the
call returns, the write and commit run in a thread, errors reach the caller at the next save or
`wait`, and a writer killed mid-write leaves the previous checkpoint the latest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcdist.errors import CheckpointError
from hpcdist.store import CheckpointStore
from hpcdist.store.checkpoint import directory as layout
from tests.support.cli import REPO
from tests.support.infer import run_ranks
from tests.support.rankctx import rank_context


def test_async_save_commits_the_state_as_it_was_at_the_call(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    store.save_async(1, {"net": {"w": w, "b": torch.ones(3, dtype=torch.bfloat16)}, "meta": {"lr": 0.1}})
    w.add_(100.0)  # training goes on: the checkpoint must not see this
    stats = store.wait()
    assert stats is not None and stats.path == store.path(1) and store.latest() == stats.path
    got = store.load(1)
    assert np.array_equal(got.tree["net"]["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert got.tree["meta"]["lr"] == 0.1 and got.tree["net"]["b"].dtype == torch.bfloat16
    store.save_async(2, {"net": {"w": w, "b": torch.zeros(3)}, "meta": {"lr": 0.2}})  # reuses step 1's arrays
    store.save_async(3, {"net": {"w": w * 2, "b": torch.zeros(3)}, "meta": {"lr": 0.3}})  # waits for step 2
    assert store.wait() is not None and store.wait() is None
    assert store.steps() == [2, 3]
    assert np.array_equal(store.load(2).tree["net"]["w"], w.numpy())
    assert np.array_equal(store.load(3).tree["net"]["w"], (w * 2).numpy())


def test_background_error_reaches_the_next_save_and_wait(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = CheckpointStore(tmp_path / "file" / "checkpoints")
    store.save_async(1, {"net": {"w": np.ones(4)}})  # returns: the failure happens in the thread
    with pytest.raises(CheckpointError, match="writing checkpoint .*step_00000001.h5 failed"):
        store.save_async(2, {"net": {"w": np.ones(4)}})
    store.save_async(3, {"net": {"w": np.ones(4)}})  # the error was raised once; this one fails too
    with pytest.raises(CheckpointError, match="step_00000003.h5 failed"):
        store.wait()
    assert store.wait() is None


def test_killed_during_a_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A real process SIGKILLed while its background thread writes: step 1 stays the latest."""
    script = textwrap.dedent(f"""
        import time, torch
        from hpcdist.store import CheckpointStore
        store = CheckpointStore({str(tmp_path)!r})
        store.save(1, {{"model": {{"w": torch.ones(16, 16)}}}})
        big = {{f"w{{i}}": torch.full((256, 1024), float(i)) for i in range(400)}}  # 400 MiB
        store.save_async(2, {{"model": big}})
        print("returned", flush=True)
        time.sleep(120)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "returned"
        deadline = time.monotonic() + 60
        while not [p for p in layout.temporaries_in(tmp_path) if p.stat().st_size > 1 << 20]:
            assert not (tmp_path / "step_00000002.h5").exists(), "the write finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    store = CheckpointStore(tmp_path)
    assert store.latest() == store.path(1) and store.steps() == [1]
    store.verify(1)
    found = store.scan()
    assert found.latest == store.path(1) and found.temporaries


# ---------------------------------------------------------------- rank 0's I/O, every rank's outcome


def _ranks_saving(rank: int, world: int, directory: str, fault: str) -> str:
    """Every rank saves through ``ctx.checkpoints`` in a 2-rank gloo group whose collectives time
    out after 2 s; rank 0's write is slowed (`slow`) or its pruning fails (`prune`)."""
    import time as _time

    from hpcdist.store.checkpoint import single as module

    if rank == 0 and fault == "slow":
        write = module.write_tree
        module.write_tree = lambda *a, **k: (_time.sleep(5), write(*a, **k))[1]  # type: ignore[assignment]
    if rank == 0 and fault == "prune":
        def refuse(directory: Path, keep_last: int, run_of: object = None) -> tuple[Path, ...]:
            raise PermissionError(13, "Permission denied", str(Path(directory) / "step_00000000.h5"))

        module.prune = refuse  # type: ignore[assignment]
    ctx = rank_context(Path(directory), rank=rank, world=world, job_id="9", name="io", timeout_s=2, keep_last=1,
                       io_timeout_s=60, checkpoint_dir=Path(directory))
    try:
        ctx.checkpoints.save(1, {"w": torch.ones(4)})
        ctx.checkpoints.save(2, {"w": torch.ones(4)})
        return "saved"
    except CheckpointError as exc:
        return str(exc)
    finally:
        ctx.release()


def test_a_checkpoint_slower_than_the_group_timeout_is_waited_for(tmp_path: Path) -> None:
    """Rank 0 takes 5 s per write, the group's timeout is 2 s: rank 1 waits on the I/O budget."""
    assert run_ranks(2, _ranks_saving, str(tmp_path), "slow", group_timeout_s=2, timeout=60) == ["saved", "saved"]
    assert CheckpointStore(tmp_path).steps() == [2]


def test_a_pruning_error_reaches_every_rank_as_the_same_error(tmp_path: Path) -> None:
    t0 = time.monotonic()
    errors = run_ranks(2, _ranks_saving, str(tmp_path), "prune", group_timeout_s=2, timeout=60)
    assert time.monotonic() - t0 < 30  # no rank hangs until a timeout
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(f"checkpoint {tmp_path / 'step_00000001.h5'} is committed, but removing older "
                                f"checkpoints failed: Permission denied ({tmp_path / 'step_00000000.h5'})")


# What rank 0 shares with the others (a save's error, load_latest's choice, a resume's choice, the
# committed steps): the plain data share() takes, each kind as it must come back.
PLAIN: list[object] = ["", "saving step 3 failed", (3, ""), (None, "none verified"), [(5, True, "x"), (4, False, "")],
                       {"path": None}, {"path": "/c/step_00000005.h5", "older": ["/c/step_00000004.h5"]},
                       {1: 2.5, "n": [1, 2], "f": [0.5], "none": None, "ok": True}, None, 7, 1.5, True, []]


def _ranks_sharing_without_pickles(rank: int, world: int, directory: str) -> list[object]:
    """``ctx.checkpoints`` on 2 ranks with torch's object collectives (the pickling ones) made to
    fail: share() of each PLAIN value and of a value that is not data, then a save and load_latest."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def crossed(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pickle crossed between the ranks")

    names = ("broadcast_object_list", "_object_to_tensor", "_tensor_to_object")
    kept = {name: getattr(c10d, name) for name in names}  # an AttributeError here: torch renamed them
    for name in names:
        setattr(c10d, name, crossed)
    dist.broadcast_object_list = crossed
    ctx = rank_context(Path(directory), rank=rank, world=world, job_id="9", name="share",
                       checkpoint_dir=Path(directory))
    try:
        got = [ctx.checkpoints.share(v if rank == 0 else "not rank 0's", "a value") for v in PLAIN]
        try:
            refused = str(ctx.checkpoints.share(Path(directory) if rank == 0 else None, "a path"))
        except CheckpointError as exc:
            refused = str(exc)
        # rank 0's state in one file: at 2 ranks the default is the sharded save, whose planning is
        # DCP's own (it gathers and scatters its plans as pickles; issue 42 item 2)
        ctx.checkpoints.save(2, {"w": torch.arange(4.0)}, replicated=False)
        latest = ctx.checkpoints.load_latest()
        assert latest is not None
        return [got, refused, latest[0], latest[1]["w"].tolist()]
    finally:
        for name in names:
            setattr(c10d, name, kept[name])
        dist.broadcast_object_list = kept["broadcast_object_list"]
        ctx.release()


def test_share_sends_data_not_pickles_and_every_rank_gets_what_rank_0_gave(tmp_path: Path) -> None:
    """Issue 42 item 6: no rank unpickles what another process sent through ``ctx.checkpoints``."""
    got = run_ranks(2, _ranks_sharing_without_pickles, str(tmp_path), timeout=60)
    assert got[0][0] == got[1][0] == PLAIN  # == tells a tuple from a list and 1 from "1"
    assert [type(v) for v in got[1][0]] == [type(v) for v in PLAIN]  # True stays a bool, not 1
    assert got[0][1] == got[1][1]  # the same one-line error on every rank
    assert got[1][1].startswith("rank 0 cannot share a path: PosixPath") and "is not plain data" in got[1][1]
    assert got[0][2:] == got[1][2:] == [2, [0.0, 1.0, 2.0, 3.0]]


def test_a_synchronous_save_waits_for_the_background_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 100 in the background (its write held for 1 s), then step 200 at once: 200 stays the
    latest, never the older step committed last."""
    import threading

    from hpcdist.store.checkpoint import single as module

    write = module.write_tree

    def slow_in_the_thread(*args: object, **kwargs: object) -> object:
        if threading.current_thread().name.startswith("hpcdist-checkpoint"):
            time.sleep(1.0)
        return write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "write_tree", slow_in_the_thread)
    store = CheckpointStore(tmp_path)
    store.save_async(100, {"net": {"w": torch.ones(4)}})
    store.save(200, {"net": {"w": torch.full((4,), 2.0)}})
    store.wait()
    assert store.latest() == store.path(200) and store.steps() == [100, 200]
    assert np.array_equal(store.load_latest().tree["net"]["w"], np.full(4, 2.0, np.float32))  # type: ignore[union-attr]

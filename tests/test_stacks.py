"""A hang, seen: `hpcdist stacks` names where every rank of a running job stands, grouped, and
when the collective times out the job's summary names the rank that was elsewhere, and where.

The job is a plain torch script (``tests/scripts/hang.py``) on 2 nodes x 2 tasks whose last rank
sleeps while the others wait for it in an all_reduce with a short timeout.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpcdist.config.paths import JobPaths
from hpcdist.runtime.stacks import capture, is_timeout
from hpcdist.store.records.stackrecord import (
    DIST,
    LIB,
    USER,
    Frame,
    RankStack,
    ThreadStack,
    describe,
    group,
    ranks_text,
    wait_answers,
)
from tests.support.cli import REPO, job_id, run_cli, storage_sets

HANG = REPO / "tests" / "scripts" / "hang.py"
COLLECTIVE_TIMEOUT_S = 12  # long enough to ask while it hangs, short enough for the suite


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def record(rank: int, *frames: Frame, why: str = "asked") -> RankStack:
    return RankStack(rank, "n1", 100 + rank, "asked x", time.time(), why, (ThreadStack("MainThread", True, frames),))


RUNPY = Frame("<frozen runpy>", 88, "_run_code")
ENTRY = Frame("/x/hpcdist/runtime/entry.py", 182, "run_job")


def test_ranks_at_the_same_frames_are_one_group_named_by_the_users_line_and_the_collective() -> None:
    wait = (ENTRY, RUNPY, Frame("/job/train.py", 88, "<module>", "dist.all_reduce(t)", USER),
            Frame("/t/torch/distributed/c10d_logger.py", 81, "wrapper", kind=DIST),
            Frame("/t/torch/distributed/distributed_c10d.py", 2950, "all_reduce", kind=DIST))
    late = (ENTRY, RUNPY, Frame("/job/train.py", 80, "<module>", "time.sleep(600)", USER))
    stacks = {0: record(0, *wait), 1: record(1, *wait), 2: record(2, *wait), 4: record(4, *late)}

    groups = group(stacks)
    assert [(g.ranks, g.where) for g in groups] == [
        ([0, 1, 2], "all_reduce, called at train.py:88"), ([4], "train.py:80 in <module>: time.sleep(600)")]
    lines = describe(stacks, world_size=6)
    assert lines == [
        "ranks 0-2: all_reduce, called at train.py:88",
        "rank 4: train.py:80 in <module>: time.sleep(600)",
        "ranks 0-2 wait in all_reduce, called at train.py:88; elsewhere: rank 4 at train.py:80 in <module>: "
        "time.sleep(600)",
        "ranks 3,5: no answer (not started, ended, or holding Python's lock in native code)",
    ]
    assert "    /job/train.py:88 in <module>: dist.all_reduce(t)" in describe(stacks, 6, verbose=True)
    assert [ranks_text(r) for r in ([3], [0, 1, 2, 5, 7, 8])] == ["rank 3", "ranks 0-2,5,7-8"]



def test_a_rank_that_timed_out_and_left_has_answered_already(tmp_path: Path) -> None:
    """The second rank to time out does not wait for the first, which took its stack at its own
    timeout and left: that stack is its answer (a stack of an earlier run is not)."""
    started = time.time()
    files = {0: tmp_path / "stack_rank0.json", 1: tmp_path / "stack_rank1.json"}
    files[0].write_text(record(0, ENTRY, why="timeout: all_reduce failed").to_json())
    old = record(1, ENTRY, why="timeout: an earlier run")
    files[1].write_text(RankStack(**{**old.__dict__, "written": started - 60}).to_json())
    t0 = time.monotonic()
    got = wait_answers(files, time.time() + 1, 1.0, timeouts_since=started)
    assert sorted(got) == [0] and time.monotonic() - t0 >= 1.0  # rank 1's old stack is not waited past
    files[1].write_text(record(1, ENTRY, why="timeout: all_reduce failed").to_json())
    t0 = time.monotonic()
    assert sorted(wait_answers(files, time.time() + 1, 3.0, timeouts_since=started)) == [0, 1]
    assert time.monotonic() - t0 < 1.0
    assert wait_answers(files, time.time() + 1, 0.3) == {}  # without: only answers to this request count

def test_a_later_run_is_never_summarised_with_an_earlier_runs_stacks(tmp_path: Path) -> None:
    """A run timed out and wrote every rank's stack; the job ran again (a requeue) and failed
    otherwise: its summary has no "stacks at the timeout" (the earlier run's are removed as it starts)."""
    from hpcdist.config import load_site
    from hpcdist.login.postmortem import timeout_stacks
    from hpcdist.runtime import stacks

    site = load_site("local", [f"storage.{k}={tmp_path / k}" for k in ("results", "checkpoints", "scratch", "logs")])
    paths = JobPaths(site.storage, "job", "41")
    paths.progress.mkdir(parents=True)
    for rank in range(3):  # the first run: 3 ranks, each at its timeout
        paths.stack_file(rank).write_text(record(rank, ENTRY, why="timeout: all_reduce failed").to_json())
    files = {r: paths.stack_file(r) for r in range(2)}
    assert timeout_stacks(files, 2)[0].startswith("ranks 0-1: ")  # what it showed before
    time.sleep(0.05)
    stacks.start(paths, 1, 2, "n2", launch=time.time())  # the second run, at 2 ranks: rank 1 removes nothing
    assert timeout_stacks(files, 2) != []
    stacks.stop()
    stacks.start(paths, 0, 2, "n1", launch=time.time())  # its rank 0 starts
    stacks.stop()
    assert timeout_stacks(files, 2) == [] and sorted(paths.progress.glob("stack_rank*")) == []


def test_a_rank_records_every_thread_and_where_a_timeout_was_raised() -> None:
    """Real frames: a thread blocked in this file, and the main thread's stack at a raise."""
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="blocked", daemon=True)
    worker.start()
    try:
        try:
            raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")  # gloo's words
        except RuntimeError as exc:
            assert is_timeout(exc) and not is_timeout(ValueError("bad shape"))
            # a peer gone, in a message that names the budget's setting: not a timeout
            assert not is_timeout(RuntimeError("no answer within the budget of 1800 s (checkpoint.io_timeout_s), or "
                                               "rank 0 is gone (Read error: Connection reset by peer)"))
            taken = capture(3, "n2", "timeout", exc)
    finally:
        release.set()
    threads = {t.name: t for t in taken.threads}
    assert taken.threads[0].main and threads["blocked"].frames[-1].kind == LIB  # threading.py's wait
    raised = taken.main[-1]
    assert (Path(raised.file).name, raised.kind) == ("test_stacks.py", USER), raised
    assert raised.code.startswith('raise RuntimeError("Timed out waiting'), raised
    assert RankStack.from_json(taken.to_json()) == taken


def _stacks_json(jid: str) -> dict[str, Any] | None:
    result = run_cli("stacks", jid, "--json", timeout=60)
    return json.loads(result.out) if result.code == 0 else None


def hang_and_check(site: str, root: Path, world: int, sets: list[str]) -> str:
    """Submit hang.py on `world` ranks, check what `hpcdist stacks` says while it hangs and what
    the summary says after the timeout; the job id."""
    sleep_at, reduce_at = line_of(HANG, "time.sleep("), line_of(HANG, "dist.all_reduce(")
    last, others = ranks_text([world - 1]), ranks_text(list(range(world - 1)))
    submitted = run_cli("submit", "--site", site, "--set", "timeout_s=60", *sets, *storage_sets(root),
                        "--", str(HANG), str(COLLECTIVE_TIMEOUT_S))
    assert submitted.code == 0, submitted.text
    jid = job_id(submitted.out)
    seen: dict[str, Any] | None = None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # until every rank stands where the script hangs
        seen = _stacks_json(jid)
        if seen and len(seen["groups"]) == 2 and seen["groups"][0]["where"].startswith("all_reduce"):
            break
        time.sleep(1)
    assert seen is not None and seen["missing"] == [], seen
    groups = [(g["ranks"], g["where"]) for g in seen["groups"]]
    assert groups == [(list(range(world - 1)), f"all_reduce, called at hang.py:{reduce_at}"),
                      ([world - 1], f"hang.py:{sleep_at} in <module>: time.sleep(600)  # the straggler")], groups
    coll = seen["groups"][0]["collectives"]
    assert coll == {str(r): "last collective #2 all_reduce, not completed" for r in range(world - 1)}, coll

    waited = run_cli("wait", jid, timeout=120)
    assert waited.code == 1, waited.text
    assert re.search(r"Timed out waiting \d+ms", waited.out), waited.out
    assert f"    {others}: all_reduce, called at hang.py:{reduce_at} [last collective #2 all_reduce, timed out]" \
        in waited.out, waited.out
    assert f"    {last}: hang.py:{sleep_at} in <module>: time.sleep(600)" in waited.out, waited.out
    if world > 2:  # one rank against many: named as the one elsewhere
        assert f"elsewhere: {last} at hang.py:{sleep_at} in <module>: time.sleep(600)" in waited.out, waited.out
    return jid


@pytest.mark.slurm
def test_stacks_of_a_hung_job_and_its_summary_name_the_rank_that_was_elsewhere(slurm_storage: Path) -> None:
    jid = hang_and_check("local-slurm", slurm_storage, 4, ["--set", "resources.nodes=2",
                                                           "--set", "resources.tasks_per_node=2"])
    folder = slurm_storage / "logs" / "hang" / jid
    answers = [json.loads((folder / f"stack_rank{r}.json").read_text()) for r in range(4)]
    assert len({a["host"] for a in answers}) == 2, answers  # two nodes answered through the shared folder
    log = (folder / f"{jid}_3_log.err").read_text()
    assert "another rank timed out and asked for every stack" in log and "time.sleep(600)" in log, log


def test_stacks_of_a_hung_job_on_the_local_site(tmp_path: Path) -> None:
    hang_and_check("local", tmp_path / "out", 2, ["--set", "resources.tasks_per_node=2"])


def test_the_jobs_timeout_reaches_a_group_the_users_script_makes_without_one(tmp_path: Path) -> None:
    """``dist.init_process_group("gloo")`` with no ``timeout=`` in the user's script: its collectives
    wait the job's ``timeout_s`` (12 s), not torch's 30 minutes; the job ends FAILED within about
    that, with every rank's stack in the summary."""
    script = REPO / "tests" / "scripts" / "hang_default.py"
    sleep_at = line_of(script, "time.sleep(")
    t0 = time.monotonic()
    waited = run_cli("submit", "--site", "local", "--set", "timeout_s=12", "--set", "resources.tasks_per_node=2",
                     *storage_sets(tmp_path), "--wait", "--", str(script), "90", timeout=120)
    took = time.monotonic() - t0
    assert waited.code == 1 and "FAILED" in waited.out, waited.text
    assert took < 60, (took, waited.text)  # the straggler sleeps 90 s
    assert re.search(r"Timed out waiting \d+ms", waited.out), waited.out
    assert "stacks at the timeout" in waited.out, waited.out
    straggler = f"    rank 1: hang_default.py:{sleep_at} in <module>: time.sleep(float(sys.argv[1]))"
    assert straggler in waited.out, waited.out

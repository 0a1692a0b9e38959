"""A rank that its backend ends itself (NCCL's watchdog: SIGABRT, no exception in Python) still
ends with hpcdist's summary: the error it would have raised, naming the rank that stopped
answering, written before the abort and shown for the rank that left no result.

The local job runs gloo made to end ranks as NCCL does (``IMITATE_ABORT_VAR``): its collectives
never raise, and a thread aborts the rank from outside the job thread, still blocked in the
all_reduce, some seconds after the job's timeout. The same on two nodes of the Slurm cluster,
with n2's link cut and n2 marked in the health record: tests/test_network_faults.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdist.config import load_site
from hpcdist.config.contract import IMITATE_ABORT_VAR
from hpcdist.config.paths import JobPaths
from hpcdist.login.postmortem import Ending, TaskEnd, no_result
from hpcdist.runtime import abort
from hpcdist.scheduler.states import JobState
from hpcdist.store.records import last_error
from tests.support import train as fx
from tests.support.cli import REPO, rank_pids, run_cli, storage_sets
from tests.support.train import ckpt_dir, train_args, wait_for

train_root, tokens = fx.train_root, fx.tokens  # the training tests' session fixtures (token file)

SCRIPT = REPO / "tests" / "scripts" / "abort_hang.py"
WORDS = ("BenchmarkError: all_reduce at size 64 KiB failed on rank 0 (n1): TimeoutError: all_reduce #9 (default_pg) "
         "did not complete within 10 s; NCCL's watchdog ends this rank; no answer within 5 s from n2 (rank 1)")


def paths_under(root: Path) -> JobPaths:
    site = load_site("local", [f"storage.{k}={root / k}" for k in ("results", "checkpoints", "scratch", "logs")])
    paths = JobPaths(site.storage, "job", "41")
    paths.progress.mkdir(parents=True)
    return paths


def test_the_summary_gives_a_ranks_last_words_then_how_srun_saw_it_end(tmp_path: Path) -> None:
    paths = paths_under(tmp_path)
    last_error.write(paths.last_words(0), 0, "n1", WORDS)
    end = Ending({0: TaskEnd(0, "n1", "killed by SIGABRT", 0), 1: TaskEnd(1, "n2", "killed by SIGABRT", 1)},
                 TaskEnd(0, "n1", "killed by SIGABRT", 0), "")
    log = paths.progress / "41_0_log.err"
    assert no_result(log, JobState.FAILED, 0, end, paths) == f"{WORDS} (then killed by SIGABRT on n1)"
    assert no_result(log, JobState.FAILED, 0, None, paths) == f"{WORDS} (then it ended, no result)"
    # a rank that left no words: srun's word, as before
    assert no_result(log, JobState.FAILED, 1, end, paths) == \
        "killed by SIGABRT on n2 (after rank 0 on n1 was killed by SIGABRT); no result"
    # the job's cause names the rank that went first by its own error, not only by the backend's signal
    assert end.headline() == "rank 0 on n1 went first: killed by SIGABRT"
    assert end.heard(paths).headline() == f"rank 0 on n1 went first: {WORDS} (then killed by SIGABRT)"


def test_an_earlier_runs_last_words_are_removed_when_rank_0_starts(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(abort.DUMP_VAR, "0")  # prepare sets it only where unset
    monkeypatch.setenv(abort.DUMP_FILE_VAR, str(tmp_path / "fr"))
    paths = paths_under(tmp_path)
    last_error.write(paths.last_words(1), 1, "n2", WORDS)
    time.sleep(0.05)
    abort.prepare(paths, 1, launch=time.time())  # rank 1 of the next run removes nothing
    assert last_error.read(paths.last_words(1)) is not None
    abort.prepare(paths, 0, launch=time.time())
    assert last_error.read(paths.last_words(1)) is None
    shown = no_result(paths.progress / "41_1_log.err", JobState.FAILED, 1, None, paths)
    assert shown.startswith("no result and no log"), shown


def test_a_rank_aborted_in_its_collective_still_names_the_rank_that_stopped_joining(tmp_path: Path) -> None:
    """Rank 1 sleeps 22 s while rank 0 waits in an all_reduce (timeout_s 6); rank 0 is aborted 10 s
    after the timeout, inside the collective, having raised nothing."""
    sleep_at = next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "time.sleep(" in line)
    waited = run_cli("submit", "--site", "local", "--set", "timeout_s=6", "--set", "resources.tasks_per_node=2",
                     *storage_sets(tmp_path), "--wait", "--", str(SCRIPT), "22", env={IMITATE_ABORT_VAR: "10"},
                     timeout=120)
    assert waited.code == 1 and "finished: FAILED" in waited.out, waited.text
    assert re.search(r"rank 0: FAILED JobError: the job failed on rank 0 \((\S+)\): TimeoutError: all_reduce #2 "
                     r"\(default_pg\) did not complete within 6 s; the backend \(imitating NCCL's watchdog\) ends this "
                     r"rank; no answer within 5 s from \1 \(rank 1\)", waited.out), waited.out
    assert f"rank 1: abort_hang.py:{sleep_at} in <module>: time.sleep(" in waited.out, waited.out
    log = next((tmp_path / "logs").rglob("*_0_log.err")).read_text()
    assert "aborting the rank (SIGABRT)" in log and "Traceback" not in log, log  # Python saw no exception


def test_training_whose_rank_hangs_names_the_step_and_the_checkpoint_to_resume_from(train_root: Path,
                                                                                      tokens: Path) -> None:
    """train_gpt on 2 local ranks; once a checkpoint is committed rank 1 is stopped (SIGSTOP, a hung
    node); rank 0 is aborted 10 s after the step's timeout (6 s) and its error, written before,
    names the step, rank 1 and the checkpoint a resubmission resumes from."""
    root = train_root / "abort"
    args = train_args(root, tokens, "--set", "resources.tasks_per_node=2", "--set", "params.steps=5000",
                      "--set", "timeout_s=6")
    job = subprocess.Popen([sys.executable, "-m", "hpcdist.cli", *args], cwd=REPO, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO), IMITATE_ABORT_VAR: "10"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    hung = None
    try:
        wait_for((ckpt_dir(root) / "step_00000050.h5").exists, 120, "the first committed checkpoint")
        hung = wait_for(lambda: rank_pids(str(root)).get(1), 10, "rank 1's process")
        os.kill(hung, signal.SIGSTOP)
        wait_for(lambda: rank_pids(str(root)).get(0) is None, 60, "rank 0 to be aborted")
        os.kill(hung, signal.SIGKILL)  # the hung node is gone: the local job ends
        out, err = job.communicate(timeout=60)
    finally:
        if hung is not None and rank_pids(str(root)).get(1) == hung:
            os.kill(hung, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, out + err
    named = re.search(r"rank 0: FAILED JobError: training step \d+ \([^)]*\) failed on rank 0 \((\S+)\): "
                      r"TimeoutError: .* did not complete within 6 s; the backend \(imitating NCCL's watchdog\) ends "
                      r"this rank; no answer within 5 s from \1 \(rank 1\).*; resubmit to resume from (\S+\.h5) "
                      r"\(then it ended", out)
    assert named, out
    assert Path(named.group(2)).exists(), named.group(2)
    log = next((root / "logs").rglob("*_0_log.err")).read_text()
    assert "aborting the rank (SIGABRT)" in log and "Traceback" not in log, log  # Python saw no exception


def recorder(entries: list[dict[str, object]]) -> object:
    """A stand-in for one of torch's flight-recorder dump functions (JSON bytes, as torch's)."""
    import json

    def dump(includeCollectives: bool = True, onlyActive: bool = False) -> bytes:  # noqa: N803 (torch's names)
        return json.dumps({"entries": entries, "pg_status": {}}).encode()

    return dump


PENDING = {"profiling_name": "nccl:all_reduce", "state": "scheduled", "retired": False, "timeout_ms": 5000,
           "time_created_ns": time.time_ns() - 6_000_000_000, "collective_seq_id": 2,
           "process_group": ["0", "default_pg"]}


def test_under_nccl_the_overdue_collective_is_read_from_nccls_own_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build has both recorders; under NCCL the generic one is empty (as on the H100), and
    NCCL's holds the collective its watchdog timed out."""
    import torch._C._distributed_c10d as c10d

    monkeypatch.setattr(c10d, "_dump_fr_trace_json", recorder([]), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", recorder([PENDING]), raising=False)
    late = abort.overdue(None, "nccl")
    assert late is not None and late.op == "all_reduce #2 (default_pg)" and late.limit_s == 5.0
    assert abort.overdue(None, "gloo") is None  # gloo's collectives are in the generic recorder alone


def test_a_rank_ends_itself_once_its_summary_and_nccls_dump_are_written(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's abort came 15 to 72 s after the timeout: a rank whose summary is written ends
    itself as soon as the flight recorder's dump of it is in the job's folder."""
    from types import SimpleNamespace

    dump = tmp_path / "flight_recorder_rank"
    monkeypatch.setenv(abort.DUMP_FILE_VAR, str(dump))
    (tmp_path / "flight_recorder_rank3").write_bytes(b"x" * 100)
    summaries: list[str] = []
    monkeypatch.setattr(abort, "overdue", lambda limit, backend: abort.Overdue("all_reduce #2 (default_pg)", 5.0))
    monkeypatch.setattr(abort.Watch, "summarise", lambda self, late: summaries.append(late.op))

    class Ended(Exception):
        pass

    def leave(code: int) -> None:
        raise Ended(code)

    monkeypatch.setattr(abort.os, "_exit", leave)
    watch = abort.Watch(SimpleNamespace(backend="nccl", rank=3, timeout_s=5.0), None)  # type: ignore[arg-type]
    t = time.monotonic()
    with pytest.raises(Ended) as ended:
        watch.run()
    assert ended.value.args == (abort.ENDED_EXIT,) and summaries == ["all_reduce #2 (default_pg)"]
    assert time.monotonic() - t < abort.GRACE_S  # the dump was there: it did not wait out the grace

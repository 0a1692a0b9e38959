"""A rank that its backend ends itself (NCCL's watchdog: SIGABRT, no exception in Python) still
ends with hpcdist's summary: the error it would have raised, naming the rank that stopped
answering, written before the abort and shown for the rank that left no result.

The local job runs gloo made to end ranks as NCCL does (``IMITATE_ABORT_VAR``): its collectives
never raise, and a thread aborts the rank from outside the job thread, still blocked in the
all_reduce, some seconds after the job's timeout. The same on two nodes of the Slurm cluster,
with n2's link cut and n2 marked in the health record: tests/test_network_faults.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from hpcdist.config import load_site
from hpcdist.config.contract import IMITATE_ABORT_VAR
from hpcdist.config.paths import JobPaths
from hpcdist.runtime import abort
from hpcdist.scheduler.postmortem import Ending, TaskEnd, no_result
from hpcdist.scheduler.states import JobState
from hpcdist.store import lastwords
from tests.support.cli import REPO, run_cli, storage_sets

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
    lastwords.write(paths.last_words(0), 0, "n1", WORDS)
    end = Ending({0: TaskEnd(0, "n1", "killed by SIGABRT", 0), 1: TaskEnd(1, "n2", "killed by SIGABRT", 1)},
                 TaskEnd(0, "n1", "killed by SIGABRT", 0), "")
    log = paths.progress / "41_0_log.err"
    assert no_result(log, JobState.FAILED, 0, end, paths) == f"{WORDS} (then killed by SIGABRT on n1)"
    assert no_result(log, JobState.FAILED, 0, None, paths) == f"{WORDS} (then it ended, no result)"
    # a rank that left no words: srun's word, as before
    assert no_result(log, JobState.FAILED, 1, end, paths) == \
        "killed by SIGABRT on n2 (after rank 0 on n1 was killed by SIGABRT); no result"


def test_an_earlier_runs_last_words_are_removed_when_rank_0_starts(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(abort.DUMP_VAR, "0")  # prepare sets it only where unset
    monkeypatch.setenv(abort.DUMP_FILE_VAR, str(tmp_path / "fr"))
    paths = paths_under(tmp_path)
    lastwords.write(paths.last_words(1), 1, "n2", WORDS)
    time.sleep(0.05)
    abort.prepare(paths, 1, launch=time.time())  # rank 1 of the next run removes nothing
    assert lastwords.read(paths.last_words(1)) is not None
    abort.prepare(paths, 0, launch=time.time())
    assert lastwords.read(paths.last_words(1)) is None
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

"""The scheduler client (``hpcdist.scheduler.slurm``): every Slurm command with a timeout and
retries, and a failure read as *unknown*, never as *gone*.

Slurm's own commands failing or hanging cannot be produced on demand on a healthy cluster, so
these tests put a failing ``squeue`` or a hanging ``sacct`` first on PATH (a shell script that
fails, then hands over to the real one); the job they watch is a real one on the local cluster.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from hpcdist.errors import SubmitError
from hpcdist.scheduler import slurm
from hpcdist.scheduler.states import JobState
from tests.support.cli import require_slurm, run_cli, storage_sets


def fake(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + body)
    (bin_dir / name).chmod(0o755)


def flaky(bin_dir: Path, name: str, fail_every: int = 2) -> None:
    """`name` fails on every `fail_every`-th call (counting from the first), else runs the real one."""
    real = shutil.which(name)
    assert real is not None
    count = bin_dir / f"{name}.count"
    fake(bin_dir, name, f"""n=$(cat {count} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {count}
if [ $(( (n - 1) % {fail_every} )) -eq 0 ]; then
  echo "{name}: error: slurm_load_jobs error: Socket timed out" >&2; exit 1
fi
exec {real} "$@"
""")


@pytest.fixture
def path_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def sleeper(seconds: int) -> str:
    """A real job that sleeps (submitted with sbatch itself, as a user would)."""
    import subprocess

    require_slurm()
    return subprocess.run(["sbatch", "--parsable", "-p", "cpu", "-o", "/dev/null", "--wrap", f"sleep {seconds}"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


@pytest.mark.slurm
def test_a_failing_squeue_is_tried_again(path_first: Path) -> None:
    job = sleeper(30)
    try:
        flaky(path_first, "squeue")  # the first call of each read fails, the second answers
        rows = slurm.squeue_rows([job])
        assert rows is not None and JobState.from_slurm(rows[job].state) in (JobState.PENDING, JobState.RUNNING)
        assert int((path_first / "squeue.count").read_text()) == 2
    finally:
        slurm.scancel(job)


@pytest.mark.slurm
def test_a_squeue_that_keeps_failing_is_unknown_never_gone(path_first: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_slurm()
    fake(path_first, "squeue", "echo 'squeue: error: slurm_load_jobs error: Unable to contact slurm controller' >&2\n"
                               "exit 1\n")
    fake(path_first, "sacct", "echo 'sacct: error: slurmdbd: connection refused' >&2\nexit 1\n")
    monkeypatch.setenv(slurm.TRIES_VAR, "2")
    reading = slurm.read_state("12345")
    assert reading.state is JobState.UNKNOWN and not reading.absent
    vanished = slurm.Vanished(after_s=0.0)
    assert not any(vanished.gone(reading) for _ in range(5))
    # A successful, empty answer (a job Slurm no longer lists) is absence.
    fake(path_first, "squeue", "exit 0\n")
    gone = slurm.read_state("12345")
    assert gone.absent and vanished.gone(gone) is False and vanished.gone(gone) is True


@pytest.mark.slurm
def test_a_hanging_command_times_out_with_one_clear_error(path_first: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_slurm()
    fake(path_first, "sacct", "sleep 30\n")
    monkeypatch.setenv(slurm.TIMEOUT_VAR, "1")
    monkeypatch.setenv(slurm.TRIES_VAR, "2")
    t0 = time.monotonic()
    with pytest.raises(SubmitError, match=r"`sacct` did not answer within 1 s \(set HPCDIST_SLURM_TIMEOUT_S to wait "
                                          r"longer\) \(2 tries\)"):
        slurm.sacct_rows(["12345"])
    assert time.monotonic() - t0 < 10


def test_job_ids_are_checked_once_before_any_command() -> None:
    with pytest.raises(SubmitError, match=r"job id '12; rm -rf /' is not a Slurm job id"):
        slurm.squeue_rows(["12; rm -rf /"])


def test_waiting_on_a_running_job_survives_a_flaky_squeue_and_accounting_down(
        slurm_storage: Path, tmp_path: Path) -> None:
    """The job runs for 20 s; squeue fails on every other call and sacct always: the waiter must
    not say the job left the queue while it runs (before: after about 5 s), and it learns how the
    job ended from the controller itself (squeue keeps an ended job for MinJobAge)."""
    bin_dir = tmp_path / "bin"
    flaky(bin_dir, "squeue")
    fake(bin_dir, "sacct", "echo 'sacct: error: slurmdbd: connection refused' >&2\nexit 1\n")
    done = slurm_storage / "done"
    script = tmp_path / "slow.py"
    script.write_text(f"import time, pathlib\ntime.sleep(20)\npathlib.Path({str(done)!r}).write_text('x')\n")
    submitted = run_cli("submit", "--site", "local-slurm", "--set", "site.launcher.args=[]",
                        *storage_sets(slurm_storage), "--", str(script))
    assert submitted.code == 0, submitted.text
    job = submitted.out.split()[2]
    waited = run_cli("wait", job, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=200)
    assert done.exists(), f"the waiter ended while the job still ran: {waited.text}"
    assert waited.code == 0 and f"job {job} finished: COMPLETED; 1/1 ranks succeeded" in waited.out, waited.text


def test_a_users_waiters_share_one_answer_and_ask_again_only_as_the_jobs_age(path_first: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes' watchers (here two in one) on one file of her state folder: the second uses
    the answer the first got, and each asks again only once half the jobs' age has passed (2 s at
    least); squeue is asked for her queue, sacct for nothing it holds. Slurm's commands as scripts:
    only the count of questions is checked."""
    from hpcdist.scheduler import slurm_watch

    rows = "101|train|RUNNING|0:05|n1|None|0|\\n102|eval x|PENDING|0:00||Priority|1|\\n"
    fake(path_first, "squeue", f'echo "$*" >> {tmp_path}/asked\nprintf "{rows}"\n')
    fake(path_first, "sacct", f"echo sacct >> {tmp_path}/asked\nexit 1\n")
    shared = tmp_path / "state" / "queue" / "queue-x.json"
    first, second = slurm_watch.Watcher(backoff=True, shared=shared), slurm_watch.Watcher(backoff=True, shared=shared)
    clock, wall = [1000.0], time.time()
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "time", lambda: wall + clock[0] - 1000.0)  # the file's age too
    read = first.readings(["101", "102"])
    assert (read["101"].state, read["102"].state, read["102"].row.restarts) == (  # type: ignore[union-attr]
        JobState.RUNNING, JobState.PENDING, "1")
    assert read["102"].row.name == "eval x"  # type: ignore[union-attr]
    assert second.reading("102").state is JobState.PENDING  # her other process: the file, no question
    asked = (tmp_path / "asked").read_text().splitlines()
    assert asked == ["-h --me -r --states=all -O "
                     "JobArrayID:|,Name:|,State:|,TimeUsed:|,NodeList:|,Reason:|,RestartCnt:|"]
    assert oct(shared.stat().st_mode & 0o777) == "0o600" and oct(shared.parent.stat().st_mode & 0o777) == "0o700"
    for after, asks in ((1.0, 1), (2.5, 2), (3.5, 2), (5.0, 2), (5.1, 3)):  # over 2 s, then over half the age
        clock[0] = 1000.0 + after
        first.readings(["101", "102"])
        assert len((tmp_path / "asked").read_text().splitlines()) == asks, after
    first.hurry()
    clock[0] += 0.5
    first.readings(["101"])
    assert len((tmp_path / "asked").read_text().splitlines()) == 3  # hurried: asked within a second, not at once
    clock[0] += 0.6
    first.readings(["101"])
    assert len((tmp_path / "asked").read_text().splitlines()) == 4


def test_jobs_this_process_just_queued_are_first_asked_about_after_two_seconds(
        path_first: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch's answer says where a job just queued is (pending): its waiter asks the queue first
    after the first interval, as submitit's watcher does, not at once (that and halving from zero
    were two polls more than submitit's in a job's first seconds, benchmarks/controller_load.py)."""
    from hpcdist.scheduler import slurm_watch

    rows = "101|train|RUNNING|0:05|n1|None|0|\\n"
    fake(path_first, "squeue", f'echo "$*" >> {tmp_path}/asked\nprintf "{rows}"\n')
    fake(path_first, "sacct", f"echo sacct >> {tmp_path}/asked\nexit 1\n")
    watcher = slurm_watch.Watcher(backoff=True, shared=tmp_path / "state" / "queue" / "queue-x.json")
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    watcher.queued(["101"])
    for after in (0.0, 1.0, 2.0):
        clock[0] = 1000.0 + after
        assert watcher.reading("101").state is JobState.PENDING
    assert not (tmp_path / "asked").exists()
    clock[0] = 1002.1
    assert watcher.reading("101").state is JobState.RUNNING
    assert len((tmp_path / "asked").read_text().splitlines()) == 1

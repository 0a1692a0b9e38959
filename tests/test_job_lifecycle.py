"""A job's life from the login node as a user types it, on the local site and the local Slurm
cluster: `submit`, then `hpcdist jobs`, `logs` (`--rank`, `--tail`, `-f`), `wait`, `cancel`,
found from the job id alone; and the status line that shows rank 0's training step while waiting."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpcdist import progress
from hpcdist.console import StatusLine
from hpcdist.login import jobindex
from hpcdist.login.jobhandle import CANCEL_GRACE_S, KILL_WAIT_S
from hpcdist.login.watch import hms, slurm_seconds
from hpcdist.scheduler.local_jobs import group_members, process_started
from tests.support.cli import Run, job_id, run_cli, storage_sets
from tests.support.train import Background, start_now, train, wait_for

SLEEPER = "import time\nprint('sleeping now', flush=True)\ntime.sleep(900)\n"
WAIT = 300  # other helpers' jobs share the machine and the cluster: generous


@pytest.fixture(params=["local", pytest.param("local-slurm", marks=pytest.mark.slurm)])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """The site and a storage root its nodes see (the cluster's shared storage for Slurm)."""
    if request.param == "local-slurm":
        return request.param, request.getfixturevalue("slurm_storage")
    return request.param, tmp_path


def cli(*args: str, env: dict[str, str] | None = None) -> Run:
    return run_cli(*args, timeout=WAIT, env=env)


def jobs_row(jid: str) -> list[str]:
    """The job's row of `hpcdist jobs`, split into its columns."""
    result = cli("jobs")
    assert result.code == 0, result.text
    header, *rows = result.out.splitlines()
    assert header.split() == ["job", "name", "kind", "site", "state", "elapsed", "nodes", "result"]
    row = [r.split() for r in rows if r.split()[0] == jid]
    assert len(row) == 1, result.out
    return row[0]


def state_of(jid: str) -> str:
    return jobs_row(jid)[4]


def test_submit_then_follow_wait_list_and_read_the_logs(place: tuple[str, Path]) -> None:
    site, root = place
    submitted = cli("submit", "jobs/smoke.yaml", "--site", site, *storage_sets(root))
    assert submitted.code == 0, submitted.text
    jid = job_id(submitted.out)

    followed = cli("logs", jid, "-f")  # returns only once the job has ended
    assert followed.code == 0, followed.text
    assert "[rank 0/2" in followed.out and "group ready" in followed.out, followed.out
    assert state_of(jid) == "COMPLETED"

    waited = cli("wait", jid)  # re-attach from another shell: the summary of `submit --wait`
    assert waited.code == 0, waited.text
    assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in waited.out
    assert "  rank 1: ok " in waited.out

    row = jobs_row(jid)
    assert row[:5] == [jid, "smoke", "smoke", site, "COMPLETED"]
    assert row[7] == str(root / "results" / "smoke" / f"{jid}.h5")
    assert re.fullmatch(r"\d+:\d\d:\d\d", row[5]), row

    rank0 = cli("logs", jid)
    assert rank0.code == 0, rank0.text
    assert f"==> rank 0 stderr: {root / 'logs' / 'smoke' / jid / f'{jid}_0_log.err'} <==" in rank0.out
    assert "[rank 0/2" in rank0.out and "[rank 1/2" not in rank0.out
    rank1 = cli("logs", jid, "--rank", "1")
    assert "[rank 1/2" in rank1.out and "[rank 0/2" not in rank1.out, rank1.out
    every = cli("logs", jid, "--all", "--tail", "1")
    sections = [s for s in every.out.split("==> ") if s.strip()]
    assert [s.split(":")[0] for s in sections] == ["rank 0 stdout", "rank 0 stderr", "rank 1 stdout", "rank 1 stderr"]
    assert all(len(s.strip().splitlines()) == 2 for s in sections), every.out  # the header and one line


def test_cancel_a_running_job(place: tuple[str, Path], tmp_path: Path, cpu_burner: int) -> None:
    """On a loaded machine (two busy processes per CPU), as in a suite run beside other work."""
    site, root = place
    script = root / "sleeper.py"
    script.write_text(SLEEPER)
    submitted = cli("submit", "--site", site, *storage_sets(root), "--", str(script))
    assert submitted.code == 0, submitted.text
    jid = job_id(submitted.out)
    wait_for(lambda: state_of(jid) == "RUNNING", WAIT, f"job {jid} RUNNING in `hpcdist jobs`", poll=2)
    wait_for(lambda: "sleeping now" in cli("logs", jid).out, WAIT, "the script's first line in `hpcdist logs`", poll=2)
    if site == "local-slurm":  # accounting down: the running job's state still comes from squeue
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: slurmdbd: connection refused' >&2\nexit 1\n")
        (fake / "sacct").chmod(0o755)
        down = cli("jobs", env={"PATH": f"{fake}:{os.environ['PATH']}"})
        assert [r.split()[4] for r in down.out.splitlines() if r.startswith(jid)] == ["RUNNING"], down.text

    t0 = time.monotonic()
    cancelled = cli("cancel", jid)
    took = time.monotonic() - t0
    assert cancelled.code == 0, cancelled.text
    # the line, and on a loaded machine perhaps what the cancel had to kill after its grace
    assert re.fullmatch(rf"cancelled job {jid} \(sleeper\) on site {site}(; \d+ of its processes still ran 10 s after "
                        rf"the cancel: killed \(SIGKILL\))?", cancelled.out.strip()), cancelled.out
    if site == "local":  # the prompt is back once nothing of the job runs: the grace, the kill's wait at most
        assert group_members(int(jid)) == [] and took < CANCEL_GRACE_S + KILL_WAIT_S + 15, (took, cancelled.out)
    wait_for(lambda: state_of(jid) == "CANCELLED", WAIT, f"job {jid} CANCELLED in `hpcdist jobs`", poll=2)
    waited = cli("wait", jid)
    assert waited.code == 1 and f"job {jid} finished: CANCELLED" in waited.out, waited.text
    again = cli("cancel", jid)
    assert again.out.strip() == f"job {jid} (sleeper) already ended: CANCELLED; nothing to cancel"


def test_a_job_submitted_with_sigint_ignored_is_cancelled_by_it(tmp_path: Path) -> None:
    """A shell without job control (a script's `hpcdist submit ... &`, nohup, a CI runner) starts
    the submit with SIGINT ignored, which Python keeps and the job's controller inherited: the
    cancel's SIGINT stopped nothing and the job ran on until the grace's SIGKILL (before: the
    cancel's line said so after 10 s, here after 60)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    submitted = run_cli("submit", "--site", "local", *storage_sets(tmp_path), "--", str(script),
                        timeout=WAIT, sigint="SIG_IGN")
    assert submitted.code == 0, submitted.text
    jid = job_id(submitted.out)
    wait_for(lambda: "sleeping now" in cli("logs", jid).out, WAIT, "the script's first line in `hpcdist logs`", poll=1)
    cancelled = cli("cancel", jid, "--grace", "60")
    assert cancelled.out.strip() == f"cancelled job {jid} (sleeper) on site local", cancelled.text
    assert group_members(int(jid)) == []
    wait_for(lambda: state_of(jid) == "CANCELLED", WAIT, f"job {jid} CANCELLED in `hpcdist jobs`", poll=1)


def test_ctrl_c_stops_waiting_and_leaves_the_job_running(tmp_path: Path) -> None:
    """`submit --wait`, then Ctrl-C: the prompt is back with what to type next, the job runs on."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    waiting = Background(["submit", "--site", "local", *storage_sets(tmp_path), "--wait", "--", str(script)])
    try:
        jid = wait_for(lambda: re.search(r"submitted job (\d+)", waiting.printed()), WAIT, "the job id")[1]
        wait_for(lambda: "sleeping now" in cli("logs", jid).out, WAIT, "the script's first line", poll=1)
        waiting.proc.send_signal(signal.SIGINT)
        stopped = waiting.finish(timeout=30)
        assert stopped.code == 130, stopped.text
        assert (f"stopped waiting; job {jid} (sleeper) goes on: `hpcdist wait {jid}` follows it again, "
                f"`hpcdist cancel {jid}` stops it") in stopped.err, stopped.text
        assert "Traceback" not in stopped.err, stopped.err
        assert state_of(jid) == "RUNNING"
    finally:
        waiting.kill()
    assert cli("cancel", jid).code == 0


STUBBORN = """import signal, subprocess, sys, time
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(900)"])
print(f"sleeping now; child {child.pid}", flush=True)
time.sleep(900)
"""


def test_cancel_ends_every_process_of_a_local_job_that_ignores_it(tmp_path: Path) -> None:
    """A rank that ignores SIGINT and SIGTERM, and a child of its own that does too: the cancel
    kills what still runs after its grace (before: the ranks ran on for minutes)."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    submitted = cli("submit", "--site", "local", *storage_sets(tmp_path), "--", str(script))
    assert submitted.code == 0, submitted.text
    jid = job_id(submitted.out)
    line = wait_for(lambda: re.search(r"child (\d+)", cli("logs", jid).out), WAIT, "the script's first line")
    child = int(line[1])
    cancelled = cli("cancel", jid, "--grace", "2")
    assert cancelled.code == 0, cancelled.text
    assert re.fullmatch(rf"cancelled job {jid} \(stubborn\) on site local; \d+ of its processes still ran 2 s after "
                        rf"the cancel: killed \(SIGKILL\)", cancelled.out.strip()), cancelled.out
    # neither the rank's child nor the controller runs (a zombie not yet reaped has no start time)
    assert process_started(str(child)) is None and process_started(jid) is None
    wait_for(lambda: state_of(jid) == "CANCELLED", WAIT, f"job {jid} CANCELLED in `hpcdist jobs`", poll=1)


def test_waiting_shows_the_training_step_without_a_terminal(place: tuple[str, Path], tokens: Path) -> None:  # noqa: F811
    site, root = place
    short = ["--set", "params.steps=60", "--set", "params.eval.every=30", "--set", "params.checkpoint.every=30"]
    result = train(root, tokens, *short, site=site, timeout=WAIT)
    assert result.code == 0, result.text
    jid = job_id(result.out)
    lines = [ln for ln in result.out.splitlines() if ln.startswith(f"job {jid} (train_gpt): ")]
    assert lines[-1].startswith(f"job {jid} (train_gpt): COMPLETED "), result.out
    steps = [ln for ln in lines if re.search(r"  train step \d+/60  loss \d+\.\d{4}  lr [\d.e+-]+  [\d,]+ tok/s", ln)]
    assert steps, result.out
    assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in result.out


def test_waiting_shows_why_a_slurm_job_is_pending(slurm_storage: Path) -> None:
    # held by a BeginTime that only the test ends, once the waiter has said why the job waits
    job = Background(["submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait",
                      "--set", "site.sbatch.begin=now+600", *storage_sets(slurm_storage)])
    try:
        pending = re.compile(r"^job (\d+) \(smoke\): PENDING .*  waiting: BeginTime$", re.M)
        wait_for(lambda: pending.search(job.printed()) or job.proc.poll() is not None, WAIT, "the PENDING line")
        if found := pending.search(job.printed()):
            start_now(found.group(1))
        result = job.finish(timeout=WAIT)
    finally:
        job.kill()
        if job.proc.returncode != 0 and (held := re.search(r"submitted job (\d+)", job.printed())):
            subprocess.run(["scancel", held.group(1)], check=False)  # not left held in the queue for others
    assert result.code == 0, result.text
    jid = job_id(result.out)
    assert re.search(rf"^job {jid} \(smoke\): PENDING \d:\d\d:\d\d  waiting: BeginTime$", result.out, re.M), result.out
    assert re.search(rf"^job {jid} \(smoke\): COMPLETED \d:\d\d:\d\d$", result.out, re.M), result.out


@pytest.mark.parametrize("verb", ["logs", "wait", "cancel"])
def test_unknown_job_id_is_one_clear_line(verb: str, job_index: Path) -> None:
    result = cli(verb, "424242")
    assert result.code == 2 and result.out == ""
    assert result.err == (f"hpcdist: error: no job 424242 in the job index ({job_index / 'jobs'}); "
                          f"`hpcdist jobs` lists the jobs submitted from here\n")


def test_two_submits_at_once_both_land_in_the_index() -> None:
    def record(i: int) -> jobindex.JobRecord:
        return jobindex.JobRecord(
            job_id=str(1000 + i), site="local", scheduler="local", name=f"j{i}", kind="smoke", spec_path="x.yaml",
            submitted=float(i), host="h", tasks=2, nodes=1, folder="/f", stdout="/f/o%t", stderr="/f/e%t",
            result="/r.h5", checkpoints="/c", spec={}, site_model={},
        )

    threads = [threading.Thread(target=jobindex.write, args=(record(i),)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.job_id for r in jobindex.records()] == [str(1000 + i) for i in range(16)]
    assert jobindex.find("1003").name == "j3"
    assert (jobindex.jobs_dir() / "local" / "1003.json").stat().st_mode & 0o077 == 0  # private to the user


def test_progress_file_is_rank_0s_newest_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "_last_write", 0.0)
    progress.start(tmp_path, is_main=True)
    progress.report_progress("train", 5, 400, "loss 3.2100")
    progress.report_progress("train", 6, 400, "loss 3.1000")  # within EVERY_S of the last write: skipped
    assert progress.read_progress(tmp_path).text() == "train step 5/400  loss 3.2100"  # type: ignore[union-attr]
    progress.report_progress("train", 400, 400, "loss 1.0000")  # the last step is always written
    assert json.loads((tmp_path / "progress.json").read_text())["done"] == 400
    progress.start(tmp_path, is_main=False)
    progress.report_progress("train", 1, 400)  # not rank 0: nothing
    assert progress.read_progress(tmp_path).done == 400  # type: ignore[union-attr]


def test_status_line_prints_plain_lines_on_change_only(capsys: pytest.CaptureFixture[str]) -> None:
    line = StatusLine(every_s=3600)
    line.show("job 1: PENDING 0:00:01  waiting: Resources", "PENDING|waiting: Resources", urgent=True)
    line.show("job 1: PENDING 0:00:02  waiting: Resources", "PENDING|waiting: Resources")  # elapsed only
    line.show("job 1: RUNNING 0:00:03", "RUNNING|", urgent=True)
    line.show("job 1: RUNNING 0:00:04  train step 1/4", "RUNNING|train step 1/4")  # within every_s
    line.show("job 1: RUNNING 0:00:05  train step 2/4", "RUNNING|train step 2/4")
    line.close()  # the newest line, not printed yet
    assert capsys.readouterr().out.splitlines() == [
        "job 1: PENDING 0:00:01  waiting: Resources",
        "job 1: RUNNING 0:00:03",
        "job 1: RUNNING 0:00:05  train step 2/4",
    ]


@pytest.mark.parametrize(("text", "seconds", "shown"), [
    ("1:23", 83, "0:01:23"), ("01:02:03", 3723, "1:02:03"), ("2-01:02:03", 176523, "2-01:02:03"),
    ("INVALID", None, "-"),
])
def test_slurm_durations(text: str, seconds: float | None, shown: str) -> None:
    assert slurm_seconds(text) == seconds and hms(slurm_seconds(text)) == shown


def test_waiting_on_a_slurm_sweep_shows_each_tasks_training_step(slurm_storage: Path, tokens: Path) -> None:  # noqa: F811
    """A sweep task's rank 0 reports under the task's own name and ``ARRAYID_INDEX``, where the
    waiter of that task reads (``JobPaths.progress``)."""
    short = ["--set", "params.steps=60", "--set", "params.eval.every=30", "--set", "params.checkpoint.every=30"]
    result = train(slurm_storage, tokens, *short, "--sweep", "params.seed=1,2", "--max-parallel", "1",
                   site="local-slurm", timeout=WAIT)  # one at a time: the second still runs when its wait begins
    assert result.code == 0, result.text
    tasks = re.findall(r"^  task (\d+_\d+): (\S+)  result:", result.out, re.M)
    assert [name for _, name in tasks] == ["train_gpt-seed1", "train_gpt-seed2"], result.out
    for task, name in tasks:
        # the step comes from the task's progress file, on a RUNNING line or, when 60 steps take
        # less than one 10 s status interval on a quiet machine, on the final COMPLETED line
        assert re.search(rf"^job {task} \({name}\): (?:RUNNING|COMPLETED) \S+  train step \d+/60  loss \d+\.\d{{4}}",
                         result.out, re.M), result.out
        assert f"job {task} finished: COMPLETED; 2/2 ranks succeeded" in result.out


def test_waiting_ends_when_the_job_left_the_queue_while_accounting_is_down(
        slurm_storage: Path, tmp_path: Path) -> None:
    """Accounting down, and the job gone from the controller too (as once its MinJobAge has
    passed: here squeue's rows of ended jobs are dropped)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: slurmdbd: connection refused' >&2\nexit 1\n")
    ended = "|".join(("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL"))
    (fake / "squeue").write_text(f"#!/bin/sh\nout=$({shutil.which('squeue')} \"$@\") || exit $?\n"
                                 f"printf '%s\\n' \"$out\" | grep -Ev '\\|({ended})\\|'\nexit 0\n")
    for name in ("sacct", "squeue"):
        (fake / name).chmod(0o755)
    down = {"PATH": f"{fake}:{os.environ['PATH']}"}
    result = cli("submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait", *storage_sets(slurm_storage), env=down)
    jid = job_id(result.out)
    assert result.code != 0, result.text
    assert result.err.strip().splitlines()[-1] == (
        f"hpcdist: error: job {jid} left the queue and Slurm's accounting (sacct) is unavailable, so how it "
        f"ended is unknown; look at `hpcdist logs {jid}`"), result.text
    waited = cli("wait", jid, env=down)
    assert waited.code == result.code and waited.err == result.err.strip().splitlines()[-1] + "\n", waited.text

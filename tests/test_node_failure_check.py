"""The start of a run Slurm requeued (``hpcdist.runtime.node_failure``), in the parts a node death
is not needed for: its earlier runs read from its batch output where accounting cannot be read,
its one line read back as the job's cause, and a check that can decide nothing lets the run go on.
A dead node is Slurm's word, which a healthy cluster cannot give on demand: ``sinfo`` is a script
first on PATH here (tests/test_node_failure.py kills real nodes).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcdist.config.contract import STOPPED
from hpcdist.login.postmortem import ending
from hpcdist.runtime import node_failure
from hpcdist.scheduler.states import JobState

OUTPUT = """hpcdist: run 1 on n[3-4] at 2026-11-24T06:10:02
some rank output
hpcdist: run 2 on n[1,4] at 2026-11-24T06:10:43
"""


@pytest.fixture
def n3_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    sinfo.write_text("#!/bin/sh\nprintf 'n1|cpu*|idle|none\\nn3|cpu*|down*|Not responding\\nn4|cpu*|mixed|none\\n'\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_earlier_runs_come_from_the_batch_output_where_accounting_cannot_be_read(n3_down: None) -> None:
    """A run with a node Slurm says is dead now ended by a node failure; the last one at the
    requeue time slurmctld gives; a run whose line is missing makes the whole answer unknown."""
    runs = node_failure.runs_from_output(OUTPUT, 1, requeued_at="2026-11-24T06:10:40")
    assert runs is not None and [(r.state, r.nodes, r.end) for r in runs] == [
        ("NODE_FAIL", "n[3-4]", "2026-11-24T06:10:40")]
    two = node_failure.runs_from_output(OUTPUT + "hpcdist: run 3 on n1 at 2026-11-24T06:20:00\n", 2)
    assert two is not None and [(r.state, r.end) for r in two] == [
        ("NODE_FAIL", "2026-11-24T06:10:43"), ("REQUEUED", "2026-11-24T06:20:00")]
    assert node_failure.runs_from_output(OUTPUT, 3) is None


@pytest.fixture
def n3_drained_n4_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sinfo: n3 drained for maintenance (healthy), n4 dead; scontrol notes its calls and answers nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text(
        "#!/bin/sh\nprintf 'n1|cpu*|idle|none\\nn3|cpu*|drained|maintenance\\nn4|cpu*|down*|Not responding\\n'\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path


def test_without_accounting_a_requeue_the_job_asked_for_or_a_drained_node_is_no_node_death(
        n3_drained_n4_down: Path) -> None:
    """Run 1 on n3 (drained since: maintenance) and run 2 on n4 (dead now, but the run asked for
    its own requeue, noted by the requeue itself) both ended by no node failure; run 3 on n4 with
    no such note did."""
    from hpcdist.runtime import requeue

    record = n3_drained_n4_down / "logs" / "job" / "7" / "requeues.txt"
    again = requeue.requeue_for({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}, record)
    assert again is not None and again() == ""  # run 2 (restart 1) preempted: scontrol requeue 7
    assert (n3_drained_n4_down / "scontrol.calls").read_text().splitlines()[-1] == "requeue 7"
    assert requeue.requeued_runs(record) == {2}
    output = ("hpcdist: run 1 on n3 at 2026-11-24T06:10:02\nhpcdist: run 2 on n4 at 2026-11-24T06:11:00\n"
              "hpcdist: run 3 on n4 at 2026-11-24T06:12:00\nhpcdist: run 4 on n1 at 2026-11-24T06:13:00\n")
    runs = node_failure.runs_from_output(output, 3, requeued=requeue.requeued_runs(record))
    assert runs is not None and [r.state for r in runs] == ["REQUEUED", "REQUEUED", "NODE_FAIL"]


def test_the_stop_line_is_the_jobs_cause() -> None:
    line = "node n3 died (run 1 ended NODE_FAIL at T); on_node_failure is fail, so this run ends before its ranks start"
    end = ending(f"hpcdist: run 1 on n3 at T\n{STOPPED}{line}\n", [])
    assert end.headline() == line and end.first is None
    # one verdict, one state: the run's own check ends the job NODE_FAIL, as the waiter's does
    assert end.state(JobState.FAILED) is JobState.NODE_FAIL
    assert ending("hpcdist: run 1 on n3 at T\n", []).state(JobState.FAILED) is JobState.FAILED


def test_a_check_that_cannot_decide_lets_the_run_go_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No restart: nothing is read. A requeued run whose job pickle cannot be read: one warning
    line, exit 0 (the check is never what stops a job)."""
    assert node_failure.main([str(tmp_path / "%j")], env={"SLURM_JOB_ID": "7"}) == 0
    assert capsys.readouterr().err == ""
    assert node_failure.main([str(tmp_path / "%j")], env={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}) == 0
    err = capsys.readouterr().err
    assert err.startswith("hpcdist: warning: the node failure check of this requeued run could not decide, the run "
                          "goes on: FileNotFoundError") and err.count("\n") == 1, err


def _fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Job 77 requeued after its first run on n[1-4] ended NODE_FAIL; n3 is down now, n2 and n4
    busy with other jobs (live, not free: they count as nodes left, docs/job-spec.md); scontrol
    update and scancel note their calls in ``calls``."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    tools = {
        "scontrol": f'echo "scontrol $*" >> {calls}\ncase "$*" in *show*) echo "JobId=77 JobState=PENDING Restarts=1 '
                    'ExcNodeList=(null) ReqNodeList=(null) NumNodes=4 SubmitTime=2026-11-25T10:00:05";; esac',
        "sacct": "printf 'NODE_FAIL|n[1-4]|2026-11-25T10:00:00\\nPENDING|None assigned|Unknown\\n'",
        "sinfo": "printf 'n1|cpu*|idle|none\\nn2|cpu*|allocated|none\\nn3|cpu*|down*|Not responding\\n"
                 "n4|cpu*|mixed|none\\n'",
        "scancel": f'echo "scancel $*" >> {calls}',
    }
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize(("spec", "expect"), [
    ({"kind": "train_gpt"}, "NumNodes=3 NumTasks=3"),  # resumes at another world size: shrinks by default
    ({"kind": "train_gpt", "resources": {"nodes": 4, "min_nodes": 4}}, "resources.min_nodes=4"),
    ({"kind": "python", "on_node_failure": "requeue"}, "cannot resume at another world size"),
])
def test_a_job_that_could_never_run_without_its_dead_node_shrinks_or_ends(
        spec: dict[str, object], expect: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 nodes asked of the 4-node partition, n3 died and is excluded: a job whose kind resumes at
    another world size runs again on the 3 left; one whose floor (min_nodes) is above that, or
    that cannot resume at another size, is cancelled with one line saying why and what to set
    (before: it pended for good, `Nodes required for job are DOWN, DRAINED or reserved`)."""
    from hpcdist.config import load_site
    from hpcdist.config.spec import JobSpec
    from hpcdist.kinds import registry  # noqa: F401 - the kinds, registered
    from hpcdist.login.node_failure_wait import NodeFailures

    calls = _fake_slurm(tmp_path, monkeypatch)
    roots = ("results", "checkpoints", "scratch", "logs")
    site = load_site("local-slurm", [f"storage.{k}={tmp_path / k}" for k in roots])
    job = JobSpec.model_validate({"name": "big", "resources": {"nodes": 4}, **spec})
    failures = NodeFailures("77", job, site, job.paths(site, "77"))
    failures.poll(JobState.PENDING)
    said = calls.read_text()
    assert "ExcNodeList=n3" in said or "scancel 77" in said, said
    if expect.startswith("NumNodes"):
        assert expect in said and "scancel" not in said and failures.cause == "", said
    else:
        assert "scancel 77" in said and "update" not in said, said
        assert failures.cause.startswith("node n3 died (run 1 ended NODE_FAIL at 2026-11-25T10:00:00); it ") and \
            expect in failures.cause and "it could never start, so Slurm's requeue was cancelled (" in failures.cause, \
            failures.cause


def test_a_job_run_again_on_fewer_nodes_reports_the_ranks_of_its_last_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Job 77 asked 4 nodes x 2 tasks, n3 died and it ran again on the 3 left (its node failure
    record says so; squeue lists its nodes): ``JobHandle.num_tasks`` is 6, not the 8 submitted."""
    import time
    from types import SimpleNamespace

    from hpcdist.config import load_site
    from hpcdist.config.spec import JobSpec
    from hpcdist.login.jobhandle import JobHandle
    from hpcdist.login.jobindex import JobRecord
    from hpcdist.login.submit import Submission
    from hpcdist.store.records import node_failures

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho '77|big|COMPLETED|1:00|n[1-2,4]|None'\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    roots = ("results", "checkpoints", "scratch", "logs")
    site = load_site("local-slurm", [f"storage.{k}={tmp_path / k}" for k in roots])
    spec = JobSpec.model_validate({"name": "big", "kind": "smoke", "resources": {"nodes": 4, "tasks_per_node": 2}})
    record = JobRecord("77", "local-slurm", "slurm", "big", "smoke", "command line", time.time(), "login", 8, 4,
                       "", "", "", "", "", spec.model_dump(mode="json"), site.model_dump(mode="json"))
    handle = JobHandle(record, Submission(job=SimpleNamespace(job_id="77"), spec=spec, site=site, script=""))
    assert handle.num_tasks == 8  # no node failure on record: as submitted
    node_failures.add(spec.paths(site, "77").node_failures, [node_failures.NodeFailure("n3", "T", 1, time.time())])
    assert handle.num_tasks == 6


def test_a_timeout_marks_the_silent_node_under_slurms_name_not_the_ranks_host_name(
        n3_down: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Ranks whose host names are not Slurm's (``n3.cluster.local``, a ``login-7`` Slurm has no
    node of): after a timeout's roll call, the silent node is marked as Slurm names it (``n3``),
    which later submissions exclude; a host Slurm does not know is logged, not marked."""
    import torch.distributed as dist

    from hpcdist.config import load_site
    from hpcdist.runtime.rollcall import roll_call
    from hpcdist.store.records import health

    site = load_site("local-slurm", [f"storage.scratch={tmp_path / 'scratch'}"])
    said = roll_call(0, ["n1", "n3.cluster.local", "login-7"], wait_s=0.3, store=dist.HashStore(), site=site,
                     job_id="7", what="an all_reduce")
    assert "n3.cluster.local (rank 1)" in said and "login-7 (rank 2)" in said, said
    assert [m.node for m in health.marks(site)] == ["n3"]
    assert "not marking login-7 in the node health record: Slurm knows no node of that name" in caplog.text

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

from hpcdist.runtime import node_failure
from hpcdist.scheduler.postmortem import STOPPED, ending

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


def test_the_stop_line_is_the_jobs_cause() -> None:
    line = "node n3 died (run 1 ended NODE_FAIL at T); on_node_failure is fail, so this run ends before its ranks start"
    end = ending(f"hpcdist: run 1 on n3 at T\n{STOPPED}{line}\n", [])
    assert end.headline() == line and end.first is None


def test_a_check_that_cannot_decide_lets_the_run_go_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No restart: nothing is read. A requeued run whose job pickle cannot be read: one warning
    line, exit 0 (the check is never what stops a job)."""
    assert node_failure.main([str(tmp_path / "%j")], env={"SLURM_JOB_ID": "7"}) == 0
    assert capsys.readouterr().err == ""
    assert node_failure.main([str(tmp_path / "%j")], env={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}) == 0
    err = capsys.readouterr().err
    assert err.startswith("hpcdist: warning: the node failure check of this requeued run could not decide, the run "
                          "goes on: FileNotFoundError") and err.count("\n") == 1, err

"""The job index (``hpcdist.login.jobindex``) stays bounded, and keeps what a job ended as."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import hpcdist
from hpcdist.login import jobindex
from tests.support.cli import run_cli


def record(i: int, submitted: float, ended: str | None = None) -> jobindex.JobRecord:
    return jobindex.JobRecord(
        job_id=str(5000 + i), site="local", scheduler="local", name=f"j{i}", kind="smoke", spec_path="x",
        submitted=submitted, host="h", tasks=1, nodes=1, folder="/nonexistent", stdout="o", stderr="e",
        result="r", checkpoints="c", spec={}, site_model={}, ended=ended)


def test_the_index_keeps_the_newest_jobs_and_forgets_old_ended_ones() -> None:
    now = time.time()
    for i in range(8):
        jobindex.write(record(i, now - 1000 + i))
    jobindex.write(record(8, now - 90 * 86400, ended="COMPLETED"))  # ended three months ago
    jobindex.write(record(9, now - 90 * 86400))  # never seen ending: kept until the count bound
    forgotten = jobindex.prune("local", keep=6, keep_days=60)
    left = [r.job_id for r in jobindex.records()]
    assert sorted(forgotten) == ["5000", "5001", "5008", "5009"]
    assert left == [str(5000 + i) for i in range(2, 8)]


def test_a_local_job_whose_files_were_deleted_shows_what_it_ended_as(tmp_path: Path) -> None:
    storage = {f"site.storage.{k}": str(tmp_path / k) for k in ("results", "checkpoints", "scratch", "logs")}
    job = hpcdist.Executor(site="local", tasks_per_node=1, time_min=5, set=storage).submit(abs, -3)
    assert job.result(timeout_s=180) == 3
    shutil.rmtree(job.record.folder)  # the user cleans up the logs and results
    listed = json.loads(run_cli("jobs", "--json").out)
    row = next(r for r in listed if r["job_id"] == job.job_id)
    assert row["state"] == "COMPLETED", row  # before: FAILED (no result files left to read)
    assert row["logs"] == job.record.folder and row["result"] == str(job.submission.paths.result())
    assert hpcdist.job(job.job_id).state is hpcdist.JobState.COMPLETED


def test_a_record_another_hpcdist_version_wrote_is_listed_and_named_not_a_traceback() -> None:
    """A record whose spec this version cannot load (a field a newer hpcdist added: a member's
    job index, read by two versions during an upgrade): `jobs` lists it, `wait` says so in one line."""
    done = jobindex.write(record(90, time.time()))
    payload = json.loads(done.read_text())
    payload["spec"] = {"name": "j90", "kind": "smoke", "field_of_a_newer_version": {}}
    done.write_text(json.dumps(payload))
    listed = run_cli("jobs")
    assert listed.code == 0 and "Traceback" not in listed.text, listed.text
    assert "5090" in listed.out and "UNKNOWN" in listed.out, listed.out
    waited = run_cli("wait", "5090", "--site", "local")
    assert waited.code != 0 and "Traceback" not in waited.text, waited.text
    assert len(waited.err.strip().splitlines()) == 1, waited.err
    assert "written by another hpcdist version" in waited.err, waited.err
    done.unlink()

"""The command line over ``JobHandle`` (``hpcdist.jobhandle``): `jobs`, `wait`, `cancel`, and the
status line of ``submit --wait``.

Every command finds the job through the index and re-attaches a handle, so waiting is the same
whether the job was submitted by this process or another. States come from the scheduler client
(``hpcdist.scheduler``), one batched query for a whole table. While waiting, one status line
(``console.StatusLine``) shows the state, the elapsed time, the queue reason while pending, and
rank 0's newest progress (``hpcdist.progress``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcdist.jobhandle import JobHandle
from hpcdist.jobindex import JobRecord, records
from hpcdist.scheduler import slurm
from hpcdist.scheduler.states import JobState
from hpcdist.submit import Finished
from hpcdist.watch import hms, slurm_seconds


def print_finished(job_id: str, finished: Finished) -> int:
    """The per-rank summary `submit --wait` and `wait` end with; the exit code (0: success)."""
    outcomes = finished.outcomes
    failed = [o for o in outcomes if not o.ok]
    print(f"job {job_id} finished: {finished.state.value}; "
          f"{len(outcomes) - len(failed)}/{len(outcomes)} ranks succeeded")
    if finished.cause:
        print(f"  cause: {finished.cause}")
    for o in outcomes:
        if o.ok:
            shown = {k: v for k, v in o.summary.items() if k not in ("rank", "timings")}
            print(f"  rank {o.rank}: ok {json.dumps(shown, default=str)}")
        else:
            print(f"  rank {o.rank}: FAILED {o.error}")
    return 0 if finished.ok else 1


# ---------------------------------------------------------------- listing


@dataclass(frozen=True)
class JobRow:
    record: JobRecord
    state: str  # the state, with the queue reason while pending
    elapsed: str
    nodes: str


def job_rows(recs: list[JobRecord]) -> tuple[list[JobRow], str]:
    """One row per job: Slurm's from one batched squeue and sacct call, local ones from their
    processes and results; and a note when Slurm's accounting could not be read."""
    watcher = slurm.Watcher()
    readings = watcher.readings([r.job_id for r in recs if r.scheduler == "slurm"])
    note = ""
    if watcher.accounting_error:
        note = f"Slurm's accounting is not available ({watcher.accounting_error}): the states of ended jobs are UNKNOWN"
    rows = []
    for r in recs:
        if r.scheduler != "slurm":
            state = JobHandle(r).state
            end = time.time() if state is JobState.RUNNING else _last_write(r)
            rows.append(JobRow(r, state.value, hms(end - r.submitted), r.host))
            continue
        reading = readings[r.job_id]
        row = reading.row
        if row is None:
            rows.append(JobRow(r, JobState.UNKNOWN.value, "-", "-"))
            continue
        state_text = reading.state.value
        if reading.state is JobState.PENDING and row.reason not in ("", "None"):
            state_text += f" ({row.reason})"
        rows.append(JobRow(r, state_text, hms(slurm_seconds(row.elapsed)), row.nodes or "-"))
    return rows, note


def _last_write(record: JobRecord) -> float:
    """When a local job last wrote a log or result: its end, near enough."""
    times = [p.stat().st_mtime for p in Path(record.folder).glob(f"{record.job_id}_*") if p.is_file()]
    return max(times, default=record.submitted)


# ---------------------------------------------------------------- commands


def cmd_jobs(args: argparse.Namespace) -> int:
    from hpcdist.console import table, text

    recs = records()
    if args.last:
        recs = recs[-args.last:]
    if not recs:
        print("no jobs in the job index yet; `hpcdist submit` records each job it submits")
        return 0
    rows, note = job_rows(recs)
    grid = table("job", "name", "kind", "site", "state", "elapsed", "nodes", "result",
                 left=("job", "name", "kind", "site", "state", "nodes", "result"))
    for row in rows:
        r = row.record
        grid.add_row(r.job_id, r.name, r.kind, r.site, row.state, row.elapsed, row.nodes, r.result)
    sys.stdout.write(text(grid))
    if note:
        print(note, file=sys.stderr)
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    handle = JobHandle.find(args.job_id, args.site)
    return print_finished(handle.job_id, handle.wait(timeout_s=args.timeout, show=True))


def cmd_cancel(args: argparse.Namespace) -> int:
    print(JobHandle.find(args.job_id, args.site).cancel())
    return 0

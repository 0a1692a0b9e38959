"""The command line over plans and ``JobHandle`` (``hpcdist.login.plan``, ``hpcdist.login.jobhandle``):
`submit` (one job, a chain, a sweep), `jobs`, `wait`, `cancel`.

Every command finds the job through the index and re-attaches a handle, so waiting is the same
whether the job was submitted by this process or another. States come from the scheduler client
(``hpcdist.scheduler``), one batched query for a whole table. While waiting, one status line
(``console.StatusLine``) shows the state, the elapsed time, the queue reason while pending, and
rank 0's newest progress (``hpcdist.progress``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist.errors import HpcdistError
from hpcdist.login import load as load_
from hpcdist.login import plan as plan_
from hpcdist.login import submit as sub_
from hpcdist.login.jobhandle import JobHandle
from hpcdist.login.jobindex import JobRecord, records
from hpcdist.login.node_failure_wait import describe
from hpcdist.login.standby import continued_in
from hpcdist.login.submit import Submission
from hpcdist.login.watch import Finished, hms, slurm_seconds, watch
from hpcdist.scheduler import slurm_watch
from hpcdist.scheduler.states import JobState


def print_finished(job_id: str, finished: Finished, excluded: list[str] | None = None) -> int:
    """The per-rank summary `submit --wait` and `wait` end with; the exit code (0: success).
    `excluded`: the nodes that died under the job and that it ran again without."""
    outcomes = finished.outcomes
    failed = [o for o in outcomes if not o.ok]
    print(f"job {job_id} finished: {finished.state.value}; "
          f"{len(outcomes) - len(failed)}/{len(outcomes)} ranks succeeded")
    if finished.cause:
        print(f"  cause: {finished.cause}")
    for line in excluded or []:
        print(f"  ran again without node {line}")
    for o in outcomes:
        if o.ok:
            shown = {k: v for k, v in o.summary.items() if k not in ("rank", "timings")}
            print(f"  rank {o.rank}: ok {json.dumps(shown, default=str)}")
        else:
            print(f"  rank {o.rank}: FAILED {o.error}")
    if finished.stacks:
        print("  stacks at the timeout (`hpcdist stacks` groups them the same way):")
        for line in finished.stacks:
            print(f"    {line}")
    if finished.note:
        print(f"  note: {finished.note}")
    return 0 if finished.ok else 1


# ---------------------------------------------------------------- submitting


def submit(req: load_.Request, paths: list[str], chain: bool, wait: bool, wait_timeout: float | None) -> int:
    """`hpcdist submit`: one job, a --chain of specs, or a --sweep; the exit code."""
    if len(paths) > 1 or chain:
        return _chain(req, paths, chain, wait, wait_timeout)
    if req.sweeps:
        return _sweep(req, wait, wait_timeout)
    from hpcdist.kinds.registry import prepare

    job, site, origin = load_.load(req)
    t0 = time.perf_counter()
    made = plan_.make(prepare(job, site).spec, site, origin)
    submission = sub_.schedule(made)[0]
    took = time.perf_counter() - t0
    out, err = submission.job.paths.stdout, submission.job.paths.stderr
    spec = submission.spec
    print(f"submitted job {submission.job_id} ({spec.name}, kind {spec.kind}) to site {site.name} in {took:.2f} s")
    print(f"  logs:   {out}")
    print(f"          {err}")
    print(f"  result: {submission.result_path}")
    _print_notes(made)
    if not wait:
        return 0
    finished = watch(submission, timeout_s=wait_timeout)
    return print_finished(submission.job_id, finished, describe(submission.paths))


def _print_notes(made: plan_.Plan) -> None:
    """The nodes the site's health record kept the job from, and why (as the script's comments);
    GPUs the job leaves unasked on a node that has them."""
    for line in made.excluded.lines():
        print(f"  node health: {line}")
    if made.gpu_note:
        print(f"  note: {made.gpu_note}")


def _chain(req: load_.Request, paths: list[str], chain: bool, wait: bool, wait_timeout: float | None) -> int:
    """`submit A.yaml B.yaml C.yaml --chain`: each link waits for the one before (afterok). Every
    link is loaded and checked before the first is submitted. On Slurm a failed link cancels the
    rest (kill-on-invalid-dep); on the local site the links run in turn and a failure stops them."""
    from hpcdist.errors import ConfigError
    from hpcdist.kinds.registry import prepare

    if not chain or req.sweeps or req.argv:
        raise ConfigError(f"submit {' '.join(paths)}: several job specs run one after another with --chain "
                          f"(and without --sweep or `-- SCRIPT`); or submit them one by one")
    links = load_.chain_links(req, paths)
    site = links[0][1]
    local = site.scheduler != "slurm"
    after: list[str] = list(req.after)
    submissions: list[Submission] = []
    for n, (job, _, origin) in enumerate(links, 1):
        if local and submissions and not _link_ok(submissions[-1], wait_timeout, links[n - 1:]):
            return 1
        link = plan_.make(prepare(job, site).spec, site, dataclasses.replace(origin, after=tuple(after)))
        submission = sub_.schedule(link)[0]
        waits = f" after job {after[0]}" if after else ""
        print(f"chain {n}/{len(links)}: submitted job {submission.job_id} ({job.spec.name}, kind {job.spec.kind})"
              f"{waits}; result: {submission.result_path}")
        _print_notes(link)
        after = [] if local else [submission.job_id]  # the local site orders the links by waiting
        submissions.append(submission)
    if local:
        return 0 if _link_ok(submissions[-1], wait_timeout, []) else 1
    for n, submission in enumerate(submissions if wait else []):
        if not _link_ok(submission, wait_timeout, links[n + 1:]):
            return 1
    return 0


def _link_ok(submission: Submission, wait_timeout: float | None, rest: list[Any]) -> bool:
    """Wait for a chain's link and print how it ended; when it failed, what becomes of `rest`."""
    finished = watch(submission, timeout_s=wait_timeout)
    print_finished(submission.job_id, finished)
    if not finished.ok and rest:
        names = ", ".join(job.spec.name for job, _, _ in rest)
        print(f"chain stopped at job {submission.job_id} ({submission.spec.name}): " + (
            f"not run: {names}" if submission.site.scheduler != "slurm" else
            f"Slurm cancels the rest ({names}): their afterok dependency can no longer be satisfied"))
    return bool(finished.ok)


def _sweep(req: load_.Request, wait: bool, wait_timeout: float | None) -> int:
    """`submit SPEC --sweep KEY=V1,V2 ...`: one Slurm job array, a task per combination (on the
    local site the tasks run one at a time)."""
    from hpcdist.kinds.registry import prepare

    base, site, origin = load_.load(req)
    tasks = [prepare(job, site).spec for job in load_.sweep_jobs(req, site)]
    subs: list[Submission] = []
    if site.scheduler == "slurm":
        made = plan_.make(base.spec, site, origin, tasks)
        subs = sub_.schedule(made)
        limit = f", at most {req.max_parallel} at a time" if req.max_parallel else ""
        print(f"submitted job array {subs[0].job_id.split('_')[0]} ({base.spec.name}, kind {base.spec.kind}, "
              f"{len(subs)} tasks{limit}) to site {site.name}")
        _print_notes(made)
    failed = 0
    for i, spec in enumerate(tasks):
        if site.scheduler != "slurm":
            subs.append(sub_.schedule(plan_.make(spec, site, dataclasses.replace(origin, sweeps=())))[0])
        print(f"  task {subs[i].job_id}: {spec.name}  result: {subs[i].result_path}")
        if wait or site.scheduler != "slurm":
            finished = watch(subs[i], timeout_s=wait_timeout)
            print_finished(subs[i].job_id, finished)
            failed += not finished.ok
    return 1 if failed else 0


# ---------------------------------------------------------------- listing


@dataclass(frozen=True)
class JobRow:
    record: JobRecord
    state: str  # the state, with the queue reason while pending
    elapsed: str
    nodes: str
    excluded: str = ""  # nodes that died under the job, which it ran again without: "n3 (died in run 1, ...)"


def job_rows(recs: list[JobRecord]) -> tuple[list[JobRow], str]:
    """One row per job: Slurm's from one batched squeue and sacct call, local ones from their
    processes and results; and a note when Slurm's accounting could not be read."""
    watcher = slurm_watch.Watcher()
    readings = watcher.readings([r.job_id for r in recs if r.scheduler == "slurm"])
    note = ""
    if watcher.accounting_error:
        note = f"Slurm's accounting is not available ({watcher.accounting_error}): the states of ended jobs are UNKNOWN"
    rows = []
    for r in recs:
        if r.scheduler != "slurm":
            try:
                state = JobHandle(r).state
            except HpcdistError:  # a record another hpcdist version wrote: listed, its state unknown
                rows.append(JobRow(r, JobState.UNKNOWN.value, "-", r.host))
                continue
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
        if reading.state.final and (after := continued_in(r)):  # its batch node died: its standby runs it on
            state_text += f" (run on in job {after})"
        rows.append(JobRow(r, state_text, hms(slurm_seconds(row.elapsed)), row.nodes or "-", _excluded(r)))
    return rows, note


def _excluded(record: JobRecord) -> str:
    """The job's node failures (``hpcdist.store.records.node_failures``), one phrase each."""
    from hpcdist.config.paths import node_failure_record
    from hpcdist.store.records import node_failures

    if not record.result:
        return ""
    return "; ".join(f.describe() for f in node_failures.read(node_failure_record(Path(record.result))))


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
    if not recs and not args.json:
        print("no jobs in the job index yet; `hpcdist submit` records each job it submits")
        return 0
    rows, note = job_rows(recs)
    if args.json:  # for scripts and tests: one object per job, the index's paths whole
        print(json.dumps([{"job_id": r.record.job_id, "name": r.record.name, "kind": r.record.kind,
                           "site": r.record.site, "state": r.state, "elapsed": r.elapsed, "nodes": r.nodes,
                           "excluded": r.excluded, "took_over": r.record.took_over,
                           "result": r.record.result, "checkpoints": r.record.checkpoints,
                           "logs": r.record.folder} for r in rows], indent=1))
        if note:
            print(note, file=sys.stderr)
        return 0
    grid = table("job", "name", "kind", "site", "state", "elapsed", "nodes", "result",
                 left=("job", "name", "kind", "site", "state", "nodes", "result"))
    for row in rows:
        r = row.record
        nodes = f"{row.nodes} (ran again without {row.excluded})" if row.excluded else row.nodes
        grid.add_row(r.job_id, r.name, r.kind, r.site, row.state, row.elapsed, nodes, r.result)
    sys.stdout.write(text(grid))
    if note:
        print(note, file=sys.stderr)
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    handle = JobHandle.find(args.job_id, args.site)
    finished = handle.wait(timeout_s=args.timeout, show=True)
    return print_finished(handle.job_id, finished, describe(handle.submission.paths))


def cmd_cancel(args: argparse.Namespace) -> int:
    handle = JobHandle.find(args.job_id, args.site)
    print(handle.cancel() if args.grace is None else handle.cancel(grace_s=args.grace))
    return 0

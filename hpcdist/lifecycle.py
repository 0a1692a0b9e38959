"""A job's life after ``submit``, from any shell on the login node: `jobs`, `wait`, `cancel`.

Every command finds the job through the index (``hpcdist.jobindex``) and re-attaches a
``Submission`` to it, so waiting is ``submit.wait`` whether the job was submitted by this
process or another. States come from ``submit`` (squeue and sacct on Slurm); on the local site
a job runs while submitit's controller process lives, and its ranks' result files say how it
ended. While waiting, one status line (``console.StatusLine``) shows the state, the elapsed
time, the queue reason while pending, and rank 0's newest progress (``hpcdist.progress``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist import submit as sub_
from hpcdist.errors import SubmitError
from hpcdist.jobindex import JobRecord, find, mark_cancelled, records
from hpcdist.polling import poll_until
from hpcdist.submit import Finished, JobState, Submission

# ---------------------------------------------------------------- re-attaching


def controller_alive(pid: str) -> bool:
    """Whether the local controller `pid` (a local job's id) still runs: hpcdist's
    (``submit.LOCAL_CONTROLLER``), or submitit's own for a job submitted by an older hpcdist."""
    proc = Path("/proc") / pid
    if not Path("/proc/self").is_dir():  # no procfs (macOS): any live process of that id
        try:
            os.kill(int(pid), 0)
        except (OSError, ValueError):
            return False
        return True
    try:
        cmdline = (proc / "cmdline").read_bytes()
        stat = (proc / "stat").read_text()
    except OSError:
        return False
    controllers = (sub_.LOCAL_CONTROLLER.encode(), b"submitit.local._local")
    return any(name in cmdline for name in controllers) and stat.rsplit(")", 1)[-1].split()[0] != "Z"


@functools.cache
def _attached_local_class(site: str) -> Any:
    """submitit's LocalJob for a job started by another process: it runs while the controller
    lives; once gone it ended, cancelled if `hpcdist cancel` says so in the index."""
    from submitit.local.local import LocalJob

    class AttachedLocalJob(LocalJob):
        def get_info(self, mode: str = "force") -> dict[str, str]:
            if self._process is not None:
                return dict(super().get_info(mode))
            if controller_alive(str(self.job_id)):
                return {"jobState": "RUNNING"}
            return {"jobState": "INTERRUPTED" if find(str(self.job_id), site).cancelled else "FINISHED"}

    return AttachedLocalJob


def attach(record: JobRecord) -> Submission:
    """A Submission for an indexed job, as ``submit`` returned it, for ``submit.wait``."""
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec

    tasks = list(range(record.tasks))
    if record.scheduler == "slurm":
        import submitit

        job: Any = submitit.SlurmJob(folder=record.folder, job_id=record.job_id, tasks=tasks)
    else:
        job = _attached_local_class(record.site)(folder=record.folder, job_id=record.job_id, tasks=tasks)
    spec, site = JobSpec.model_validate(record.spec), Site.model_validate(record.site_model)
    return Submission(job=job, spec=spec, site=site, script="")


def current_state(record: JobRecord) -> JobState:
    """The job's state now (Slurm: sacct, else squeue; local: the controller and results)."""
    if record.scheduler == "slurm":
        return sub_.slurm_state(record.job_id)
    state = JobState.from_submitit_local(str(attach(record).job.state))
    if state is JobState.COMPLETED and not _local_results_ok(record):
        return JobState.FAILED  # submitit's local controller says FINISHED whatever its ranks did
    return state


def _local_results_ok(record: JobRecord) -> bool:
    from submitit.core.utils import JobPaths, pickle_load

    for rank in range(record.tasks):
        path = JobPaths(record.folder, record.job_id, rank).result_pickle
        try:
            if pickle_load(path)[0] != "success":
                return False
        except Exception:  # missing, half-written or unreadable: not a success
            return False
    return True


# ---------------------------------------------------------------- waiting


def slurm_seconds(text: str) -> float | None:
    """Slurm's ``[D-][HH:]MM:SS`` (squeue %M, sacct Elapsed) in seconds; None if it is not one."""
    days, _, clock = text.strip().rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        day_s = int(days) * 86400 if days else 0
    except ValueError:
        return None
    if not 2 <= len(parts) <= 3:
        return None
    h, m, s = ([0] + parts)[-3:]
    return float(day_s + h * 3600 + m * 60 + s)


def hms(seconds: float | None) -> str:
    """``1:02:03``, ``2-01:02:03`` for more than a day; ``-`` when unknown."""
    if seconds is None or seconds != seconds:
        return "-"
    s = int(max(0.0, seconds))
    days, s = divmod(s, 86400)
    if days:
        return f"{days}-{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class _Watcher:
    """What the status line says at each poll of ``submit.wait``."""

    def __init__(self, sub: Submission, submitted: float, every_s: float) -> None:
        from hpcdist.console import StatusLine

        self.sub, self.submitted = sub, submitted
        self.line = StatusLine(every_s)
        from hpcdist.progress import progress_folder

        self.folder = progress_folder(sub.site.storage.logs, sub.spec.name, sub.job_id)  # where the node writes
        self.last_state: JobState | None = None
        self.queue: sub_.JobStatus | None = None
        self.queue_read = float("-inf")

    def __call__(self, state: JobState) -> None:
        from hpcdist.progress import read_progress

        now = time.monotonic()
        if self.sub.site.scheduler == "slurm" and (state is not self.last_state or now - self.queue_read >= 5.0):
            self.queue, self.queue_read = self._slurm_row(state), now
        elapsed: float | None = time.time() - self.submitted
        if self.queue is not None:
            from_slurm = slurm_seconds(self.queue.elapsed)
            elapsed = None if from_slurm is None else from_slurm + (0.0 if state.final else now - self.queue_read)
        words = [f"job {self.sub.job_id} ({self.sub.spec.name}): {state.value} {hms(elapsed)}"]
        detail = ""
        if state is JobState.PENDING and self.queue is not None and self.queue.reason not in ("", "None"):
            detail = f"waiting: {self.queue.reason}"
        elif state is not JobState.PENDING:
            report = read_progress(self.folder)
            detail = report.text() if report is not None else ""
        line = "  ".join(words + ([detail] if detail else []))
        self.line.show(line, key=f"{state.value}|{detail}", urgent=state is not self.last_state)
        self.last_state = state

    def _slurm_row(self, state: JobState) -> sub_.JobStatus | None:
        """squeue's row while the job is queued or runs (reason, elapsed), sacct's once it ended."""
        if state.final:
            try:
                return sub_.sacct_rows([self.sub.job_id])[-1]
            except (SubmitError, IndexError):
                return None
        return sub_.squeue_rows([self.sub.job_id]).get(self.sub.job_id)


def watch(sub: Submission, submitted: float | None = None, timeout_s: float | None = None,
          every_s: float = 10.0) -> Finished:
    """``submit.wait`` with the status line; `submitted` is when the job went in (elapsed time
    while Slurm has no figure, and on the local site)."""
    watcher = _Watcher(sub, time.time() if submitted is None else submitted, every_s)
    try:
        return sub_.wait(sub, timeout_s=timeout_s, on_poll=watcher)
    finally:
        watcher.line.close()


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


# ---------------------------------------------------------------- cancelling


def cancel(record: JobRecord, wait_s: float = 15.0) -> str:
    """Cancel the job (Slurm: scancel; local: its controller, which stops the ranks); what was done."""
    state = current_state(record)
    if state.final:
        return f"job {record.job_id} ({record.name}) already ended: {state.value}; nothing to cancel"
    if record.scheduler == "slurm":
        if shutil.which("scancel") is None:
            raise SubmitError(f"`scancel` is not on PATH; cancel job {record.job_id} from a login node")
        proc = subprocess.run(["scancel", record.job_id], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SubmitError(f"scancel {record.job_id} failed: {proc.stderr.strip() or proc.returncode}")
        return f"cancelled job {record.job_id} ({record.name}) on site {record.site}"
    mark_cancelled(record)  # first: whoever waits reads CANCELLED, not FAILED, once it is gone
    try:
        os.kill(int(record.job_id), signal.SIGINT)  # submitit's own cancel: the controller stops its ranks
    except ProcessLookupError:
        pass
    if poll_until(lambda: True if not controller_alive(record.job_id) else None, wait_s, 0.2) is None:
        raise SubmitError(f"job {record.job_id}'s ranks still run {wait_s:g} s after the cancel; "
                          f"stop them with `kill {record.job_id}`")
    return f"cancelled job {record.job_id} ({record.name}) on site {record.site}"


# ---------------------------------------------------------------- listing


@dataclass(frozen=True)
class JobRow:
    record: JobRecord
    state: str  # the state, with the queue reason while pending
    elapsed: str
    nodes: str


def job_rows(recs: list[JobRecord]) -> tuple[list[JobRow], str]:
    """One row per job: running ones from squeue, ended ones from sacct, local ones from their
    processes and results; and a note when Slurm's accounting could not be read."""
    ids = [r.job_id for r in recs if r.scheduler == "slurm"]
    queued = sub_.squeue_rows(ids) if ids else {}
    accounted: dict[str, sub_.JobStatus] = {}
    note = ""
    if [i for i in ids if i not in queued]:
        try:
            accounted = {row.job_id: row for row in sub_.sacct_rows([i for i in ids if i not in queued])}
        except SubmitError as exc:
            note = f"Slurm's accounting is not available ({exc}): the states of ended jobs are UNKNOWN"
    rows = []
    for r in recs:
        if r.scheduler != "slurm":
            state = current_state(r)
            end = time.time() if state is JobState.RUNNING else _last_write(r)
            rows.append(JobRow(r, state.value, hms(end - r.submitted), r.host))
        elif r.job_id in queued:
            q = queued[r.job_id]
            state_text = JobState.from_slurm(q.state).value
            if q.reason not in ("", "None"):
                state_text += f" ({q.reason})"
            rows.append(JobRow(r, state_text, hms(slurm_seconds(q.elapsed)), q.nodes or "-"))
        elif r.job_id in accounted:
            a = accounted[r.job_id]
            rows.append(JobRow(r, JobState.from_slurm(a.state).value, hms(slurm_seconds(a.elapsed)), a.nodes or "-"))
        else:
            rows.append(JobRow(r, JobState.UNKNOWN.value, "-", "-"))
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
    record = find(args.job_id, args.site)
    sub = attach(record)
    finished = watch(sub, record.submitted, timeout_s=args.timeout)
    return print_finished(record.job_id, finished)


def cmd_cancel(args: argparse.Namespace) -> int:
    print(cancel(find(args.job_id, args.site)))
    return 0

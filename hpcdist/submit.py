"""Submission through submitit, which keeps the job's lifecycle (state, results, requeue).

On a Slurm site submitit submits hpcdist's rendered script (not its own): ``ScriptExecutor``
overrides the one method that makes the script text, so ``hpcdist render`` shows byte for
byte what is submitted. On the local site submitit's LocalExecutor runs the ranks as processes.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import SubmitError
from hpcdist.polling import poll_until
from hpcdist.render import Origin, render, submitit_folder


@functools.cache
def _script_executor_class() -> Callable[[Path, str, int, int], Any]:
    """submitit's Slurm executor with the submission script replaced by hpcdist's (made on first
    use: submitit is imported only when something is submitted)."""
    import submitit

    class ScriptExecutor(submitit.SlurmExecutor):
        def __init__(self, folder: Path, script: str, num_tasks: int, max_num_timeout: int) -> None:
            super().__init__(folder, max_num_timeout=max_num_timeout)
            self._script = script
            self._tasks = num_tasks

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return self._script

        def _num_tasks(self) -> int:
            return self._tasks

    return ScriptExecutor


@dataclass
class Submission:
    job: Any  # submitit.Job
    spec: JobSpec
    site: Site
    script: str

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def log_paths(self) -> tuple[Path, Path]:
        return self.job.paths.stdout, self.job.paths.stderr

    @property
    def result_path(self) -> Path:
        return self.spec.result_path(self.site, self.job_id)


@dataclass
class TaskOutcome:
    rank: int
    ok: bool
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def _tasks(spec: JobSpec) -> int:
    return spec.resources.world_size


def submit(spec: JobSpec, site: Site, origin: Origin) -> Submission:
    """Submit `spec` to `site`; returns as soon as the scheduler has the job."""
    import submitit
    from submitit.core.utils import FailedJobError

    from hpcdist.runtime.entry import run_rank  # the callable only; nothing runs here

    script = render(spec, site, origin)
    folder = submitit_folder(spec, site)
    if site.scheduler == "slurm":
        if shutil.which("sbatch") is None:
            raise SubmitError(f"site {site.name!r} uses Slurm but `sbatch` is not on PATH; run on a login node")
        executor: Any = _script_executor_class()(folder, script, _tasks(spec), site.preemption.max_requeues)
        executor.update_parameters(
            time=spec.time_limit_min(site),
            nodes=spec.resources.nodes,
            ntasks_per_node=spec.resources.tasks_per_node,
        )
    else:
        executor = submitit.LocalExecutor(folder)
        executor.update_parameters(
            timeout_min=spec.time_limit_min(site),
            nodes=1,
            tasks_per_node=spec.resources.tasks_per_node,
        )
        os.environ[LAUNCH_TIME_VAR] = repr(time.time())
    try:
        job = executor.submit(run_rank, spec, site)
    except FailedJobError as exc:
        raise SubmitError(f"the scheduler refused job {spec.name!r}: {_first_error_line(str(exc))}") from exc
    except OSError as exc:
        raise SubmitError(f"could not submit job {spec.name!r}: {exc}") from exc
    return Submission(job=job, spec=spec, site=site, script=script)


def wait(sub: Submission, poll_s: float = 1.0, timeout_s: float | None = None) -> list[TaskOutcome]:
    """Block until the job ends; one outcome per rank, never raising for a failed rank.

    ``timeout_s=None`` waits as long as the scheduler says the job is not done.
    """
    from submitit.core.utils import FailedJobError, UncompletedJobError

    if poll_until(lambda: True if sub.job.done(force_check=True) else None, timeout_s, poll_s) is None:
        raise SubmitError(f"job {sub.job_id} did not finish within {timeout_s:g} s; it is still {sub.job.state}")
    outcomes = []
    for rank in range(_tasks(sub.spec)):
        task = sub.job.task(rank)
        try:
            outcomes.append(TaskOutcome(rank, True, summary=dict(task.result() or {})))
        except (FailedJobError, UncompletedJobError) as exc:
            outcomes.append(TaskOutcome(rank, False, error=_first_error_line(str(exc))))
    return outcomes


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")


def _first_error_line(text: str) -> str:
    """The last `SomeError: message` line of a traceback, else the text's last line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        match = _ERROR_LINE.match(line)
        if match and match.group(1) not in {"FailedJobError", "UncompletedJobError"}:
            return f"{match.group(1)}: {match.group(2)}"
    return lines[-1].strip() if lines else "(no output)"


_FINAL = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE", "FINISHED", "INTERRUPTED")


def final_state(sub: Submission, settle_s: float = 30.0) -> str:
    """The scheduler's final word on the job: the result files can land before sacct says so.

    After `settle_s` the last state seen is returned, final or not.
    """
    last = ""

    def settled() -> str | None:
        nonlocal last
        last = status(sub.job_id)[0].state if sub.site.scheduler == "slurm" else str(sub.job.state)
        return last if last.startswith(_FINAL) else None

    return poll_until(settled, settle_s, 0.5) or last


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    name: str
    state: str
    exit_code: str
    elapsed: str
    nodes: str


def status(job_id: str) -> list[JobStatus]:
    """The job's state from Slurm's accounting (one row per requeue-visible record)."""
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise SubmitError(f"job id {job_id!r} is not a Slurm job id (digits, e.g. 1234)")
    if shutil.which("sacct") is None:
        raise SubmitError("`sacct` is not on PATH; `hpcdist status` needs Slurm's accounting")
    proc = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-P", "-n", "-o", "JobID,JobName,State,ExitCode,Elapsed,NodeList"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SubmitError(f"sacct failed for job {job_id}: {proc.stderr.strip()}")
    rows = [JobStatus(*line.split("|")[:6]) for line in proc.stdout.splitlines() if line.strip()]
    if not rows:
        raise SubmitError(f"Slurm knows no job {job_id}; check the id with `sacct` or `squeue`")
    return rows


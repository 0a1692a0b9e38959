"""Submission through submitit, which keeps the job's lifecycle (state, results, requeue).

On a Slurm site submitit submits hpcdist's rendered script (not its own): ``ScriptExecutor``
overrides the one method that makes the script text, so ``hpcdist render`` shows byte for
byte what is submitted. On the local site submitit's LocalExecutor runs the ranks as processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.config.paths import JobPaths, log_patterns
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import SubmitError
from hpcdist.files import roots
from hpcdist.files.atomic import storage_umask
from hpcdist.launchers import SAFE_PATH
from hpcdist.login import jobindex, remote, tracking
from hpcdist.scheduler import slurm
from hpcdist.scheduler.local_jobs import LOCAL_CONTROLLER, machine_gpus, process_started

if TYPE_CHECKING:
    from hpcdist.login.plan import Origin, Plan


@functools.cache
def _script_executor_class() -> Callable[..., Any]:
    """submitit's Slurm executor with the submission script replaced by hpcdist's (made on first
    use: submitit is imported only when something is submitted)."""
    import submitit

    class ScriptExecutor(submitit.SlurmExecutor):
        def __init__(self, folder: Path, script: str, num_tasks: int, max_num_timeout: int,
                     roots: tuple[Path, ...] = ()) -> None:
            super().__init__(folder, max_num_timeout=max_num_timeout)
            self._script = script
            self._roots = roots  # the site's storage roots: what a job's folder is sent below over ssh
            self._tasks = num_tasks
            self.array = False  # the script has --array: even one task is an array task (ID_0)

        @classmethod
        def affinity(cls) -> int:
            """submitit's "is Slurm here" (srun on PATH); under `--on HOST` it is on the login node."""
            return 2 if remote.active() else int(super().affinity())

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return self._script

        def _num_tasks(self) -> int:
            return self._tasks

        def _submit_command(self, command: str) -> Any:
            """submitit's own, with sbatch run by the scheduler client (a timeout, one owner)."""
            import uuid

            from submitit.core.utils import JobPaths

            tmp = uuid.uuid4().hex
            path = JobPaths.get_first_id_independent_folder(self.folder) / f".submission_file_{tmp}.sh"
            path.write_text(self._make_submission_file_text(command, tmp))
            key = None if self.array else _new_key(path.parent)  # an array's keys: one per task, below
            try:
                if remote.active():  # `--on HOST`: the script sbatch reads, and the job's folder, there first
                    remote.send(path.parent, self._roots, pickles=False)
                job_id = slurm.sbatch(path)
            except BaseException:
                if key is not None:
                    key.unlink(missing_ok=True)
                raise
            job = self.job_class(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())))
            job.paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
            if key is not None:  # before submitit moves its pickle into place, which the ranks wait for
                _place_key(key, job)
            self._write_job_id(job.job_id, tmp)
            self._set_job_permissions(job.paths.folder)
            return job

        def _internal_process_submissions(self, delayed: list[Any]) -> list[Any]:
            """An array as submitit makes one (a pickle per task, jobs ``ID_INDEX``), but with
            this script (its ``--array``), not a plain SlurmExecutor's."""
            if len(delayed) == 1 and not self.array:
                return super()._internal_process_submissions(delayed)
            import uuid

            from submitit.core.utils import JobPaths
            from submitit.slurm.slurm import SlurmJob

            pickles, keys = [], []
            for item in delayed:
                path = JobPaths.get_first_id_independent_folder(self.folder) / f"{uuid.uuid4().hex}.pkl"
                path.parent.mkdir(parents=True, exist_ok=True)
                item.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
                item.dump(path)
                pickles.append(path)
                keys.append(_new_key(path.parent))
            try:
                first = self._submit_command(self._submitit_command_str)
            except BaseException:
                for key in keys:
                    key.unlink(missing_ok=True)
                raise
            ranks = list(range(self._tasks))
            jobs: list[Any] = [SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=ranks)
                               for i in range(len(delayed))]
            for job, path, key in zip(jobs, pickles, keys, strict=True):
                _place_key(key, job)  # each task's key before its pickle, which its ranks wait for
                job.paths.move_temporary_file(path, "submitted_pickle")
            return jobs

    return ScriptExecutor


def _new_key(folder: Path) -> Path:
    """A job's store key (``hpcdist.runtime.signed_store``), made before the job is queued."""
    from hpcdist.runtime import signed_store

    return signed_store.new_key(folder)


def _place_key(key: Path, job: Any) -> None:
    """The key `key` as submitit's job `job`'s key file, once the scheduler named the job."""
    from hpcdist.runtime import signed_store

    signed_store.place_key(key, Path(job.paths.folder), str(job.job_id))


@functools.cache
def _local_executor_class() -> Callable[..., Any]:
    """submitit's LocalExecutor with hpcdist's controller (``hpcdist.runtime.local_controller``):
    the same environment submitit's ``start_controller`` passes, another module to run. Every task
    sees the job's GPUs, the first ``gpus_per_node`` of the machine's (``CUDA_VISIBLE_DEVICES``, as
    submitit's ``visible_gpus``; none for a job that asks none), and takes ``cuda:LOCAL_RANK`` as
    under torchrun (docs/gpus.md, the binding "none"). The site's
    and the job's variables are in the controller's environment (a plain Executor function has no
    bootstrap to set them), the site's ``setup`` lines run in a shell before it as submitit's
    ``local_setup`` does, and the preemption signal comes ``preemption.seconds_before_end`` before
    the time limit."""
    import submitit
    from submitit.local.local import LocalJob

    class ControllerExecutor(submitit.LocalExecutor):
        plan: Plan

        def _submit_command(self, command: str) -> Any:
            plan = self.plan
            spec, site, ntasks = plan.base, plan.site, plan.base.resources.tasks_per_node
            env = {
                **os.environ,
                "CUDA_VISIBLE_DEVICES": ",".join(machine_gpus(os.environ)[:plan.gpus_per_node]),
                **plan.env,
                "SUBMITIT_LOCAL_NTASKS": str(ntasks),
                "SUBMITIT_LOCAL_COMMAND": command,
                "SUBMITIT_LOCAL_TIMEOUT_S": str(plan.limit_s),
                "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(plan.signal_delay_s),
                "SUBMITIT_LOCAL_NODEID": "0",
                "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                "SUBMITIT_STDERR_TO_STDOUT": "1" if spec.stderr_to_stdout else "",
                "SUBMITIT_EXECUTOR": "local",
                "SUBMITIT_PREEMPTION_SIGNAL": site.preemption.signal,
                "SUBMITIT_LOCAL_WITH_SHELL": "",
            }
            controller = [sys.executable, *SAFE_PATH, "-m", LOCAL_CONTROLLER, str(self.folder)]
            # a session of its own: the job id leads the process group of every rank and its
            # children, which a cancel ends whole; a Ctrl-C of the submitting shell leaves the
            # job running, as it leaves a Slurm job (`hpcdist cancel` stops it)
            if site.setup:  # `exec`: the shell's process becomes the controller, whose id is the job's
                line = " && ".join([*site.setup, "exec " + shlex.join(controller)])
                process = subprocess.Popen(["/bin/sh", "-c", line], env=env, start_new_session=True)
            else:
                process = subprocess.Popen(controller, env=env, start_new_session=True)
            return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))

    return ControllerExecutor


@dataclass
class Submission:
    job: Any  # submitit.Job
    spec: JobSpec
    site: Site
    script: str
    record: jobindex.JobRecord | None = None  # its job index record, made at submission (kept if not written)

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def log_paths(self) -> tuple[Path, Path]:
        return self.job.paths.stdout, self.job.paths.stderr

    @property
    def paths(self) -> JobPaths:
        """The job's paths (its own name and id; an array task's progress and result are its own)."""
        return self.spec.paths(self.site, self.job_id)

    @property
    def result_path(self) -> Path:
        return self.paths.result()


def _tasks(spec: JobSpec) -> int:
    return spec.resources.world_size


def submit(spec: JobSpec, site: Site, origin: Origin) -> Submission:
    """Submit `spec` to `site`; returns as soon as the scheduler has the job."""
    from hpcdist.login.plan import make

    return schedule(make(spec, site, origin))[0]


def _executor(plan: Plan, script: str) -> Any:
    """submitit's executor for the plan's site, with its parameters (`script`: the plan's)."""
    executor: Any
    if plan.slurm:
        executor = _script_executor_class()(plan.folder, script, _tasks(plan.base),
                                            plan.site.preemption.max_requeues, plan.site.storage.roots)
    else:
        executor = _local_executor_class()(plan.folder, max_num_timeout=plan.site.preemption.max_requeues,
                                           python=shlex.quote(plan.site.python) if plan.site.python else None)
        executor.plan = plan
        os.environ[LAUNCH_TIME_VAR] = repr(time.time())
    executor.update_parameters(**plan.executor_parameters)
    return executor


Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def schedule(plan: Plan, calls: Sequence[Call] | None = None) -> list[Submission]:
    """Submit the plan's script once, running its tasks (one spec each, as a Slurm job array when
    it is one); one Submission per task, in order, each recorded in the job index.

    Each task runs hpcdist's rank function (the bootstrap, then the spec's kind), or, given
    `calls` (one per task: a plain ``hpcdist.Executor`` function), that function itself, as
    submitit runs it: no bootstrap, no torch, submitit's own checkpoint-and-requeue."""
    from hpcdist.login import render
    from hpcdist.runtime import run_rank  # the callable only; nothing runs here

    if plan.slurm and plan.array and plan.origin.part is None:  # over MaxArraySize, or a QOS's MaxSubmitJobs
        from hpcdist.login.arrays import schedule_parts

        parts = schedule_parts(plan, calls, schedule)
        if parts is not None:
            return parts
    todo: list[Call] = list(calls) if calls is not None else [(run_rank, (task, plan.site), {}) for task in plan.tasks]

    base, site, script = plan.base, plan.site, render.script(plan)
    unset = [name for name in base.env_passthrough if name not in os.environ]
    if unset:
        raise SubmitError(
            f"env_passthrough: {', '.join(unset)} not set in this shell; the job takes it from the shell you "
            f"submit from: `export {unset[0]}=...` (or read it from a file) before `hpcdist submit`"
        )
    if plan.slurm and remote.active():  # `--on HOST`: the connection, the paths, the cluster's Python and hpcdist
        remote.ready(plan)
    elif plan.slurm and shutil.which("sbatch") is None:
        raise SubmitError(f"site {site.name!r} uses Slurm but `sbatch` is not on PATH; run on a login node")
    if plan.slurm:
        from hpcdist.login.site_check import against_cluster

        against_cluster(plan)
    try:
        with storage_umask(site.storage.umask), _private_pickles(), (  # submitit's files, and the job's through sbatch
                _detached_streams() if not plan.slurm else contextlib.nullcontext()):
            roots.ready(site.storage, site.name)  # roots she may use; <root>/<user> her own, or one line why not
            for task in plan.tasks:  # the job's tracker run, once (a resubmission that resumes keeps it)
                tracking.prepare(task, site)
            executor = _executor(plan, script)
            if not plan.array:
                fn, args, kwargs = todo[0]
                jobs = [executor.submit(fn, *args, **kwargs)]
            else:
                executor.array = True
                with executor.batch():
                    pending = [executor.submit(fn, *args, **kwargs) for fn, args, kwargs in todo]
                jobs = list(pending)
            if plan.slurm and remote.active():
                remote.send_submitted(plan)  # the job's key and pickled call, which its ranks wait for
            if plan.slurm and plan.base.resources.spare_nodes:  # its batch node's death: hpcdist.runtime.standby
                from hpcdist.login.standby import queue_first

                queue_first(plan.base, site, str(jobs[0].job_id), plan.array)
    except slurm.Refused as exc:
        said = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise SubmitError(f"the scheduler refused job {base.name!r}: {said} (`hpcdist site check {site.name}` "
                          f"compares site {site.name!r} with the cluster)") from exc
    except OSError as exc:
        raise SubmitError(f"could not submit job {base.name!r}: {exc}{roots.denied_hint(exc)}") from exc
    origin = plan.origin
    submissions = [Submission(job=job, spec=task, site=site, script=script)
                   for job, task in zip(jobs, plan.tasks, strict=True)]
    for submission in submissions:  # `hpcdist jobs`, `logs`, `wait`, `cancel`, `hpcdist.job`; a failure warns
        submission.record = make_record(submission, origin)
        jobindex.add(submission.record)
    return submissions


def make_record(sub: Submission, origin: Origin) -> jobindex.JobRecord:
    """The job index's record of a job just submitted."""
    paths = sub.paths
    folder = Path(sub.job.paths.folder).absolute()
    out, err = (p.replace("%j", sub.job_id) for p in log_patterns(folder))
    return jobindex.JobRecord(
        job_id=sub.job_id, site=sub.site.name, scheduler=sub.site.scheduler, name=sub.spec.name,
        kind=sub.spec.kind, spec_path=origin.job_path or "command line", submitted=time.time(),
        host=socket.gethostname(), tasks=sub.spec.resources.world_size, nodes=sub.spec.resources.nodes,
        folder=str(folder), stdout=out, stderr=err, result=str(paths.result().absolute()),
        checkpoints=str(paths.checkpoints.absolute()),
        spec=sub.spec.model_dump(mode="json"), site_model=sub.site.model_dump(mode="json"),
        started=process_started(sub.job_id) if sub.site.scheduler != "slurm" else None,
    )


@contextlib.contextmanager
def _private_pickles() -> Iterator[None]:
    """submitit's pickles of the job's call (``<id>_submitted.pkl``: the function and its arguments,
    an ``hpcdist.Executor`` call's values included) written 0600 whatever ``storage.mode`` says, as
    the ranks write the result pickles (``hpcdist.runtime.task_runner``): submitit writes each through
    ``utils.cloudpickle_dump``, which it looks up when it writes, under a new name that it then
    renames into place, so the file is the user's alone from its first byte."""
    from submitit.core import utils

    dump = utils.cloudpickle_dump

    def private(obj: Any, filename: Any) -> None:
        with storage_umask(0o077):
            dump(obj, filename)

    utils.cloudpickle_dump = private
    try:
        yield
    finally:
        utils.cloudpickle_dump = dump


@contextlib.contextmanager
def _detached_streams() -> Iterator[None]:
    """Standard streams on /dev/null while submitit starts a local job's controller, which
    outlives `submit`: holding our stdout, it would keep `$(hpcdist submit ...)` or a pipe to
    `tee` open until the job ends. The ranks write to their own log files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        yield
    finally:
        for fd, copy in zip((0, 1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)

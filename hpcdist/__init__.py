"""hpcdist: distributed PyTorch work on Slurm clusters, from a site config and a job spec.

The package follows the job's flow, in two sides: ``config`` (site config, job spec, both
sides) -> on the login side ``login`` (plan, render, submit through submitit, the job's life
after) -> on the node side ``runtime`` (rank bootstrap, process group) -> the job kinds
(``kinds``: their registry, smoke and your own code's ``python``; ``bench``, ``train``,
``infer``) -> ``store`` (checkpoints, results). ``files``, ``scheduler``, ``launchers``,
``console`` and ``errors`` serve both sides. Only ``cli`` imports both sides.
``hpcdist.init()`` (``hpcdist.api``) is the API for the user's own code on the nodes;
``hpcdist.Executor`` and ``hpcdist.job(ID)`` submit functions and hold
jobs from Python on the login node. Importing ``hpcdist`` stays light: each name loads its
module on first use (submitit, torch and cloudpickle only when a job is submitted or run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpcdist._version import __version__

if TYPE_CHECKING:
    from submitit import DebugExecutor, DebugJob, JobEnvironment, helpers

    from hpcdist.api import Context
    from hpcdist.login.executor import AutoExecutor, Executor
    from hpcdist.login.jobhandle import JobFailed, JobHandle, JobUncompleted
    from hpcdist.login.submitit_executors import LocalExecutor, SlurmExecutor
    from hpcdist.scheduler.states import JobState

    Job = LocalJob = SlurmJob = JobHandle

__all__ = ["AutoExecutor", "Context", "DebugExecutor", "DebugJob", "Executor", "Job", "JobEnvironment", "JobFailed",
           "JobHandle", "JobState", "JobUncompleted", "LocalExecutor", "LocalJob", "SlurmExecutor", "SlurmJob",
           "__version__", "helpers", "init", "job"]
# name: (module, its name there). submitit's public names are here with submitit's meaning
# (docs/python-api.md): its own DebugExecutor, JobEnvironment and helpers; hpcdist's executors and
# its one job class for Job, LocalJob and SlurmJob.
_LAZY = {"AutoExecutor": ("hpcdist.login.executor", "AutoExecutor"), "Context": ("hpcdist.api", "Context"),
         "Executor": ("hpcdist.login.executor", "Executor"),
         "LocalExecutor": ("hpcdist.login.submitit_executors", "LocalExecutor"),
         "SlurmExecutor": ("hpcdist.login.submitit_executors", "SlurmExecutor"),
         "JobFailed": ("hpcdist.login.jobhandle", "JobFailed"), "JobHandle": ("hpcdist.login.jobhandle", "JobHandle"),
         "Job": ("hpcdist.login.jobhandle", "JobHandle"), "LocalJob": ("hpcdist.login.jobhandle", "JobHandle"),
         "SlurmJob": ("hpcdist.login.jobhandle", "JobHandle"),
         "JobState": ("hpcdist.scheduler.states", "JobState"),
         "JobUncompleted": ("hpcdist.login.jobhandle", "JobUncompleted"),
         "DebugExecutor": ("submitit", "DebugExecutor"), "DebugJob": ("submitit", "DebugJob"),
         "JobEnvironment": ("submitit", "JobEnvironment"), "helpers": ("submitit", "helpers")}


def init(**kwargs: Any) -> Context:
    """This rank's ``Context`` for the user's own code (``hpcdist.api.init``; torch loads here)."""
    from hpcdist.api import init as _init

    return _init(**kwargs)


def job(job_id: str | int, site: str | None = None) -> JobHandle:
    """Re-attach to a submitted job by its id, from any process (``hpcdist.login.jobhandle``);
    `site`, when two sites have a job of that id, as `--site` takes it: a name or a YAML path."""
    from hpcdist.login.jobhandle import JobHandle as _JobHandle

    return _JobHandle.find(job_id, site)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hpcdist' has no attribute {name!r}")

"""Hydra's multirun sweeps as hpcdist jobs: the submit side of ``hydra/launcher=hpcdist``.

The plugin class Hydra instantiates (``hydra_plugins/hpcdist_launcher``) hands each batch of a
sweep here. A batch is one ``hpcdist.Executor.map_array`` over its Hydra jobs: one Slurm job
array (``array_parallelism`` tasks at a time), or on the local site a job per item; job N of the
sweep is the hpcdist job ``<name>-N``. The launcher's settings are the executor's keywords, so
they are checked as a job spec is, before anything is queued, and hydra-submitit-launcher's names
mean what submitit's do (``hpcdist.login.submitit_params``).

A job whose task raised ends FAILED: in Slurm, in ``hpcdist jobs``, and in Hydra, whose sweep
raises the rank's error (hydra-submitit-launcher's end COMPLETED: Hydra issue 1928). With
``wait: false`` the sweep returns once it is queued, printing the job ids and the command that
follows them; each job's ``return_value`` is then its ``hpcdist.JobHandle``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import ConfigError

if TYPE_CHECKING:
    from hydra.core.utils import JobReturn

    from hpcdist.login.executor import Executor
    from hpcdist.login.jobhandle import JobHandle

log = logging.getLogger(__name__)

# The launcher's keys the executor takes as they are (a job spec's resources and top-level keys,
# and submitit's names, which ``submitit_params.translate`` maps); Slurm's options by name go to
# ``#SBATCH`` lines as submitit's ``slurm_X`` do (and are ignored on the local site, as there).
AS_THEY_ARE = ("name", "partition", "nodes", "min_nodes", "spare_nodes", "tasks_per_node", "gpus_per_node",
               "cpus_per_task", "mem_gb", "time_min", "sbatch", "timeout_min", "python", "setup", "signal_delay_s",
               "gpus_per_task", "srun_args")
SLURM_OPTIONS = ("account", "qos", "constraint", "gres", "comment", "exclude", "cpus_per_gpu", "mem_per_gpu",
                 "mem_per_cpu", "additional_parameters")
OWN = ("site", "wait", "set", "max_num_timeout", "array_parallelism", "submitit_folder", "stderr_to_stdout")


def executor(params: Mapping[str, Any]) -> Executor:
    """The launcher's settings as an ``hpcdist.Executor``: one ConfigError for the first bad one."""
    from hpcdist.login.executor import Executor

    unknown = sorted(set(params) - {*AS_THEY_ARE, *SLURM_OPTIONS, *OWN, "_target_"})
    if unknown:  # Hydra's structured config refuses these first; a config built by hand is checked here
        raise ConfigError(f"hydra/launcher=hpcdist: unknown key {unknown[0]!r}; see hydra_plugins/hpcdist_launcher/"
                          f"config.py, or set deeper job spec keys in hydra.launcher.set")
    keys = {k: params[k] for k in AS_THEY_ARE if params.get(k) not in (None, {}, [])}
    keys.update({f"slurm_{k}": params[k] for k in SLURM_OPTIONS if params.get(k) not in (None, {})})
    if params.get("stderr_to_stdout"):
        keys["stderr_to_stdout"] = True
    sets = dotted(params.get("set") or {})
    try:
        ex = Executor(params.get("submitit_folder"), site=params.get("site"),
                      max_num_timeout=params.get("max_num_timeout"), set=sets, **keys)
    except ConfigError as exc:
        raise ConfigError(f"hydra/launcher=hpcdist: {exc}") from exc
    in_image = ex.site.container is not None or any(k.startswith("container.") for k in sets)
    nodes_have_hydra(None if in_image else ex.site.python)  # an image's python is inside it: not checked here
    return ex


def nodes_have_hydra(python: str | None) -> None:
    """Each rank unpickles Hydra's objects: a site's own ``python`` (the nodes' interpreter,
    where it is not this one) without hydra-core is one line before anything is queued, not a
    ModuleNotFoundError in every job."""
    import subprocess
    import sys

    if not python or not Path(python).is_absolute() or not Path(python).exists() or \
            Path(python).resolve() == Path(sys.executable).resolve():
        return
    if subprocess.run([python, "-c", "import hydra, hpcdist"], capture_output=True, timeout=60).returncode != 0:
        raise ConfigError(f"hydra/launcher=hpcdist: the nodes' python {python} (site.python) cannot import hydra "
                          f"and hpcdist; install them there: {python} -m pip install 'hpcdist[hydra]'")


def dotted(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`set` as the executor takes it, ``{"site.storage.logs": ...}``, from Hydra's nesting of a
    dotted key (``+hydra.launcher.set.site={storage:{logs:/x}}``, or a YAML block)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Queue one batch of a sweep, then (``wait``) each job's ``JobReturn`` as Hydra's run_job made it."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import filter_overrides

    config = launcher.config
    ex = executor(launcher.params)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in config.hydra.sweep and config.hydra.sweep.mode is not None:
        os.chmod(sweep_dir, int(str(config.hydra.sweep.mode), 8))
    log.info(f"hpcdist sweep on site {ex.site.name}, output dir : {sweep_dir}")
    calls = []
    for idx, overrides in enumerate(job_overrides, initial_job_idx):
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
        calls.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
    jobs = ex.map_array(launcher, *zip(*calls, strict=True), max_parallel=launcher.params.get("array_parallelism"),
                        first_index=initial_job_idx)
    if not launcher.params.get("wait", True):
        print(queued(jobs, ex.site.name), flush=True)
        return [queued_return(job, overrides) for job, overrides in zip(jobs, job_overrides, strict=True)]
    return [job_return(job, overrides) for job, overrides in zip(jobs, job_overrides, strict=True)]


def queued(jobs: Sequence[JobHandle], site: str) -> str:
    """What ``wait: false`` prints: the jobs' ids and the one command that follows them."""
    ids = " ".join(j.job_id for j in jobs)
    follow = f"hpcdist wait {jobs[0].job_id}" if len(jobs) == 1 else f"hpcdist jobs --last {len(jobs)}"
    return f"queued {len(jobs)} job{'s' * (len(jobs) > 1)} of the sweep on site {site}: {ids}\n  follow: {follow}"


def job_return(job: JobHandle, overrides: Sequence[str]) -> JobReturn:
    """The job's JobReturn from its rank 0; a failed job's is FAILED, with hpcdist's error."""
    from hydra.core.utils import JobReturn, JobStatus

    from hpcdist.login.jobhandle import JobFailed

    try:
        ret = job.result()
    except JobFailed as exc:
        return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=exc)
    if not isinstance(ret, JobReturn):  # not this launcher's call on the nodes: never Hydra's COMPLETED
        err = RuntimeError(f"job {job.job_id} returned {type(ret).__name__}, not Hydra's JobReturn")
        return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=err)
    return ret


def queued_return(job: JobHandle, overrides: Sequence[str]) -> JobReturn:
    """A queued job's JobReturn: Hydra's sweep reads each one, so it is COMPLETED (the launch
    is), and its ``return_value`` is the job's handle (``.wait()``, ``.result()``)."""
    from hydra.core.utils import JobReturn, JobStatus

    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=job)

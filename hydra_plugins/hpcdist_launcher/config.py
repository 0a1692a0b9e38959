"""The settings of ``hydra/launcher=hpcdist``, in Hydra's ConfigStore.

Every key of a job spec's ``resources``, its ``sbatch``, and ``site``; then the names
hydra-submitit-launcher's ``submitit_slurm`` takes, so its configs load unchanged (their meaning
is ``hpcdist.Executor``'s, which reads them: ``hpcdist.login.submitit_params``). None leaves a
value to the site and the job spec's defaults. Anything deeper goes in ``set``, as
``hpcdist.Executor(set=...)`` takes it: ``{"env.OMP_NUM_THREADS": 2, "site.launcher.kind": "mpirun"}``.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional  # OmegaConf reads typing's names (pyproject: ruff UP006, UP045 off here)

from hydra.core.config_store import ConfigStore


@dataclass
class HpcdistLauncherConf:
    _target_: str = "hydra_plugins.hpcdist_launcher.launcher.HpcdistLauncher"
    # a site name or YAML path; None: $HPCDIST_SITE, else the Slurm cluster srun talks to (read from
    # it), else this machine (the local site)
    site: Optional[str] = None
    # false: return once the sweep is queued, printing its job ids and the command that follows them
    wait: bool = True
    # the hpcdist job's name; a sweep's job N is <name>-N (its checkpoints, results, progress)
    name: str = "${hydra.job.name}"

    # a job spec's resources (docs/job-spec.md)
    partition: Optional[str] = None
    nodes: Optional[int] = None
    min_nodes: Optional[int] = None
    spare_nodes: Optional[int] = None
    tasks_per_node: Optional[int] = None
    gpus_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[float] = None
    time_min: Optional[float] = None
    # a job spec's sbatch: any other #SBATCH option ({mail_type: END, reservation: maint})
    sbatch: Dict[str, Any] = field(default_factory=dict)
    # deeper job spec keys and the site's ("site.…")
    set: Dict[str, Any] = field(default_factory=dict)

    # hydra-submitit-launcher's names. Slurm's options, each an #SBATCH line (ignored on the local site):
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    gres: Optional[str] = None
    comment: Optional[str] = None
    exclude: Optional[str] = None
    cpus_per_gpu: Optional[int] = None
    mem_per_gpu: Optional[str] = None
    mem_per_cpu: Optional[str] = None
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    # submitit's: time_min, the site's python, setup lines and preemption warning, the requeues
    # after a time-out, the array's tasks at a time, the folder of the job's pickles and logs
    timeout_min: Optional[float] = None
    python: Optional[str] = None
    setup: Optional[List[str]] = None
    signal_delay_s: Optional[int] = None
    max_num_timeout: Optional[int] = None
    array_parallelism: Optional[int] = None
    stderr_to_stdout: bool = False
    submitit_folder: Optional[str] = None
    # refused with the reason (hpcdist binds GPUs by the site, srun's line is the site's launcher)
    gpus_per_task: Optional[int] = None
    srun_args: Optional[List[str]] = None


ConfigStore.instance().store(group="hydra/launcher", name="hpcdist", node=HpcdistLauncherConf, provider="hpcdist")

"""The plugin class Hydra instantiates for ``hydra/launcher=hpcdist``.

``launch`` runs where Hydra was started and hands the sweep to ``hpcdist.login.hydra_sweep``;
``__call__`` runs on every rank of each job and is Hydra's own ``run_job``, as
hydra-submitit-launcher runs it, so a job's output folder, ``.hydra/`` files and log are Hydra's;
``checkpoint`` is submitit's requeue of the same call on a time-out or preemption.
"""

from typing import Any, Dict, List, Optional, Sequence  # Hydra's own annotations (Python 3.8 style)

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict


class HpcdistLauncher(Launcher):
    """Hydra's jobs as hpcdist jobs: the settings are ``config.HpcdistLauncherConf``'s."""

    def __init__(self, **params: Any) -> None:
        self.params: Dict[str, Any] = {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in params.items()}
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from hpcdist.login.hydra_sweep import launch  # on use: Hydra's plugin scan imports this module

        return launch(self, job_overrides, initial_job_idx)

    def __call__(self, sweep_overrides: List[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: Dict[type, Singleton]) -> JobReturn:
        """One Hydra job, on one rank. Every rank writes the job's ``.hydra/`` files, the same
        bytes (so a job whose rank 0 was stopped by another rank's failure still has them). A task
        that raised fails the job (Slurm's FAILED, the rank's error in ``hpcdist wait``), where
        Hydra's run_job alone would return."""
        import submitit

        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        env = submitit.JobEnvironment()
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(sweep_overrides))
        with open_dict(config.hydra.job):
            config.hydra.job.id, config.hydra.job.num = env.job_id, job_num
        ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                      job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir")
        if ret.status == JobStatus.FAILED:
            raise ret._return_value
        return ret

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's Checkpointable: the same job again, requeued (its task resumes from its checkpoints)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

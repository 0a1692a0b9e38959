"""submitit's ``LocalExecutor`` and ``SlurmExecutor`` with submitit's meaning, over
``hpcdist.Executor``: a script that names one keeps running where it meant to, whatever the
machine (``Executor(folder)`` goes to Slurm wherever ``srun`` is on PATH, as submitit's
``AutoExecutor`` does). Their jobs are hpcdist's (``hpcdist.JobHandle``); submitit's own
``DebugExecutor``, ``JobEnvironment`` and ``helpers`` are re-exported as they are
(``hpcdist/__init__.py``, docs/python-api.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcdist.login.executor import Executor
from hpcdist.login.submitit_params import slurm_keys


class LocalExecutor(Executor):
    """submitit's ``LocalExecutor(folder, max_num_timeout=3, python=None)``: always this machine
    (the ``local`` site), wherever ``srun`` is on PATH; submitit's parameter names, bare or
    ``local_``. `max_num_timeout` None: the site's ``preemption.max_requeues`` (3)."""

    def __init__(self, folder: str | Path | None = None, max_num_timeout: int | None = None,
                 python: str | None = None, **kwargs: Any) -> None:
        extra: dict[str, Any] = {} if python is None else {"python": python}
        super().__init__(folder, cluster="local", max_num_timeout=max_num_timeout, **extra, **kwargs)


class SlurmExecutor(Executor):
    """submitit's ``SlurmExecutor(folder, max_num_timeout=3, python=None)``: always a Slurm site
    (``site=`` or ``$HPCDIST_SITE``, else the cluster srun talks to), its parameters by the names
    submitit's SlurmExecutor takes (``partition``, ``time``, ``ntasks_per_node``, ``mem="16GB"``,
    ``job_name``, ``additional_parameters``, ...; ``submitit_params.slurm_keys``)."""

    def __init__(self, folder: str | Path | None = None, max_num_timeout: int | None = None,
                 python: str | None = None, *, site: str | None = None,
                 spec: str | Path | Mapping[str, Any] | None = None, set: Mapping[str, Any] | None = None,  # noqa: A002
                 **keys: Any) -> None:
        extra: dict[str, Any] = {} if python is None else {"python": python}
        super().__init__(folder, site=site, cluster="slurm", max_num_timeout=max_num_timeout, spec=spec, set=set,
                         **slurm_keys({**keys, **extra}))

    def update_parameters(self, **keys: Any) -> None:
        """Change parameters, by submitit's SlurmExecutor's names, for later submissions."""
        super().update_parameters(**slurm_keys(keys))

"""One rank of the running job, as the bootstrap made it: its rank, the process group, the spec,
the site, and helpers (hpcdist's own record; the user's code gets ``hpcdist.Context``, the
handles of ``hpcdist.api`` over it).

The built-in job kinds receive a ``JobRank`` and their validated params; they never read the
launcher's environment themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.paths import JobPaths
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.runtime.rankinfo import RankInfo

if TYPE_CHECKING:
    import torch


@dataclass
class JobRank:
    """One rank of the running job: what hpcdist's bootstrap decided for it."""

    spec: JobSpec
    site: Site
    info: RankInfo
    backend: str
    device: torch.device
    timeout_s: float
    hosts: tuple[str, ...]
    log: logging.Logger
    timings: dict[str, float] = field(default_factory=dict)
    mpi_comm: Any = None
    requeue: Callable[[], str] | None = None  # requeues, or says why Slurm does it (runtime.requeue)
    endpoint: Any = None  # group.Endpoint: where the job's TCPStore listens (the python kind's MASTER_ADDR)
    store: Any = None  # the job's store (rank 0 serves it)
    standalone: bool = False  # hpcdist.init() outside any hpcdist job: the spec and site are init()'s own
    run_id: str = ""  # the job id where the launcher names none (hpcdist.init() outside a job)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    @property
    def job_id(self) -> str:
        return self.run_id or self.info.job_id or "local"

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    @property
    def paths(self) -> JobPaths:
        """Every path of this job (``hpcdist.config.paths``)."""
        return self.spec.paths(self.site, self.job_id)

    def result_path(self, suffix: str = "") -> Path:
        """``<results root>/<job name>/<job id><suffix>.h5`` on shared storage."""
        return self.paths.result(suffix)

    @property
    def checkpoint_dir(self) -> Path:
        """Stable across requeues and resubmissions of the same job name."""
        return self.paths.checkpoints

    def run_attrs(self) -> dict[str, Any]:
        """Root attributes for this run's result file."""
        from hpcdist.store.results import run_attrs

        return run_attrs(
            kind=self.spec.kind,
            job_name=self.spec.name,
            job_id=self.job_id,
            site=self.site.name,
            hosts=self.hosts,
            num_nodes=self.info.num_nodes,
            spec_json=self.spec.model_dump_json(),
            site_json=self.site.model_dump_json(),
        )

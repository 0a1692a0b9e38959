"""hpcdist: distributed PyTorch work on Slurm clusters, from a site config and a job spec.

The package follows the job's flow: ``config`` (site config, job spec) -> ``render`` (sbatch
script) -> ``submit`` (submitit) on the login node, then on the nodes ``runtime`` (rank
bootstrap, process group) -> ``jobs`` (the workloads) -> ``results`` / checkpoints.
Only ``cli`` imports both sides. ``hpcdist.init()`` (``hpcdist.api``) is the API for the user's
own code; importing ``hpcdist`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcdist.api import Context

__version__ = "0.1.0"


def init(**kwargs: Any) -> Context:
    """This rank's ``Context`` for the user's own code (``hpcdist.api.init``; torch loads here)."""
    from hpcdist.api import init as _init

    return _init(**kwargs)

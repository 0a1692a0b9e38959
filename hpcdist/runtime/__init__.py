"""The node side: what runs on the allocated nodes, in every rank: rank facts, the process group,
the job entry point, the requeue and node-failure checks, the hang watchers.

Nothing here imports the render or submit side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec


def run_rank(spec: JobSpec, site: Site) -> dict[str, Any]:
    """What ``hpcdist submit`` hands submitit to pickle and call on every rank: this module's
    name, so the login node does not import the bootstrap (``hpcdist.runtime.entry.run_rank``,
    which it calls) only to name it."""
    from hpcdist.runtime.entry import run_rank as run

    return run(spec, site)

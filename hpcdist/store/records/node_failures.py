"""The record of a job's node failures: which node died, when, in which run, and that the job ran
again without it. ``hpcdist.runtime.node_failure`` writes it, for the waiter on the login side
(``hpcdist.login.node_failure_wait``) when it excludes the node from the requeued job, or for the requeued run's
own start on its head node when nobody waits (keyed by run: recorded once); the result file of
the run that follows carries it (``hpcdist.store.results``), and ``submit --wait`` and ``hpcdist
jobs`` show it. One small JSON file beside the job's result
(``hpcdist.config.paths.node_failure_record``), replaced atomically.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcdist.files.atomic import atomic_path


@dataclass(frozen=True)
class NodeFailure:
    """One node that died under a run of the job, and was excluded from the next."""

    node: str
    when: str  # when Slurm ended the run (its accounting's End, the cluster's local time)
    run: int  # which run of the job it ended (1: the first)
    excluded_at: float  # seconds since the epoch: when hpcdist excluded it (the waiter) or recorded it (the run)

    def describe(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.excluded_at))
        return f"{self.node} (died in run {self.run}, ended {self.when}; excluded at {stamp})"


def read(path: Path) -> list[NodeFailure]:
    """The failures recorded at `path`; none when there is no record (or it is unreadable), or
    when another user could have written it (``hpcdist.files.trust``: said in a warning)."""
    from hpcdist.files.trust import UntrustedFileError, read_trusted

    try:
        data = json.loads(read_trusted(path, limit=1 << 20))
        return [NodeFailure(**entry) for entry in data]
    except UntrustedFileError as exc:
        logging.getLogger("hpcdist").warning("ignoring the node failure record: %s", exc.why)
        return []
    except (OSError, ValueError, TypeError):
        return []


def add(path: Path, failures: list[NodeFailure]) -> list[NodeFailure]:
    """The record at `path` with `failures` added (a node already recorded for a run is kept once)."""
    known = read(path)
    seen = {(f.node, f.run) for f in known}
    merged = known + [f for f in failures if (f.node, f.run) not in seen]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps([asdict(f) for f in merged], indent=1))
    return merged


def attrs(path: Path) -> dict[str, str]:
    """Result-file attributes for the record at `path`: ``excluded_nodes`` (``n3,n4``) and
    ``node_failures`` (one line per failure); none when no node failed."""
    failures = read(path)
    if not failures:
        return {}
    return {"excluded_nodes": ",".join(dict.fromkeys(f.node for f in failures)),
            "node_failures": "; ".join(f.describe() for f in failures)}

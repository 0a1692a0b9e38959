"""Experiment trackers on the nodes (node side): what a job logs to MLflow, TensorBoard or W&B.

Rank 0 alone logs. ``open_run`` gives the job's run (the identity the login side made at submit,
``hpcdist.config.tracking``) as one ``Run`` that fans each metric out to every tracker the job
names, each behind the small ``Tracker`` interface in its own module, each fed by its own
background thread (``channel.py``): a tracker that is down or slow costs the job one warning a
minute, never a stalled step. ``environment`` is what an unchanged script gets to find the run.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpcdist.config.tracking import Identity, Tracking, read_identity
from hpcdist.config.tracking import environment as _environment
from hpcdist.track.base import Item, Tracker, read_high_water
from hpcdist.track.channel import Channel

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec

__all__ = ["Run", "Tracker", "Item", "open_run", "environment", "report"]

log = logging.getLogger("hpcdist")


class TrackedJob(Protocol):
    """What `report` needs of a running job (the rank's ``JobRank`` is one): the tracker sits
    below the runtime, so it names the fields, not the class."""

    spec: JobSpec
    site: Site

    @property
    def job_id(self) -> str: ...

    @property
    def rank(self) -> int: ...


def environment(spec: JobSpec, site: Site) -> dict[str, str]:
    """The variables every rank gets for the job's run (none when it names no tracker)."""
    tracking = spec.trackers(site)
    if not tracking.names:
        return {}
    folder = spec.paths(site).tracking
    return _environment(tracking, read_identity(folder), folder)


class Run:
    """The job's run in every tracker it names: metrics by step, parameters, artifacts."""

    def __init__(self, channels: list[Channel]):
        self.channels = channels

    @property
    def names(self) -> list[str]:
        return [c.tracker.name for c in self.channels]

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """`values` at `step` (numbers only; a value that is not one is left out)."""
        clean = {k: float(v) for k, v in values.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        if clean:
            self._put(Item("metrics", step=int(step), values=clean))

    def backfill(self, rows: Iterable[tuple[int, dict[str, float]]]) -> None:
        """Metrics at steps an earlier start took and may not have sent (its rank 0 was killed
        within a second of them, before its tracker thread sent them): the resumed state's rows,
        each tracker getting those past the last step it took before this start. Called by a
        restart before it logs its own first step."""
        rows = list(rows)
        for channel in self.channels:
            for step, values in rows:
                if channel.taken is None or step > channel.taken:
                    channel.put(Item("metrics", step=int(step), values=dict(values)))

    def params(self, values: dict[str, Any]) -> None:
        self._put(Item("params", values={k: str(v)[:500] for k, v in values.items()}))

    def tags(self, values: dict[str, str]) -> None:
        """Values kept whole (JSON), which a later start may change: MLflow tags, W&B config,
        TensorBoard text."""
        self._put(Item("tags", values=dict(values)))

    def artifact(self, path: Path) -> None:
        self._put(Item("artifact", path=Path(path)))

    def _put(self, item: Item) -> None:
        for channel in self.channels:
            channel.put(item)

    def close(self, finished: bool, timeout_s: float = 20.0) -> None:
        """Send what is left and end the run (`finished`: the job completed; else it leaves for a
        requeue): every tracker at once, all within `timeout_s`, so a requeue is never held up."""
        events = [channel.close(finished) for channel in self.channels]
        deadline = time.monotonic() + timeout_s
        for channel, done in zip(self.channels, events, strict=True):
            if not done.wait(max(0.0, deadline - time.monotonic())) or channel.pending:
                channel.say_unsent(timeout_s)


def _tracker(name: str, tracking: Tracking, identity: Identity, folder: Path, job_id: str,
             high: int | None) -> Tracker:
    if name == "mlflow":
        from hpcdist.track.mlflow_run import MlflowTracker

        return MlflowTracker(identity, high, job_id)
    if name == "tensorboard":
        from hpcdist.track.tensorboard_run import TensorboardTracker

        return TensorboardTracker(folder, high)
    from hpcdist.track.wandb_run import WandbTracker

    return WandbTracker(identity, folder, high)


def open_run(spec: JobSpec, site: Site, job_id: str, rank: int) -> Run | None:
    """Rank 0's run in the job's trackers; None on other ranks, for a job that names none, or when
    the identity made at submit is missing (a launch that did not go through ``hpcdist submit``:
    said once)."""
    tracking = spec.trackers(site)
    if rank != 0 or not tracking.names:
        return None
    folder = spec.paths(site).tracking
    identity = read_identity(folder)
    if identity is None:
        log.warning("tracking: no run identity in %s (the job was not submitted by hpcdist submit?): "
                    "nothing is sent to %s", folder, ", ".join(tracking.names))
        return None
    highs = {name: read_high_water(folder, name) for name in tracking.names}
    channels = [Channel(_tracker(name, tracking, identity, folder, job_id, highs[name]), folder, taken=highs[name])
                for name in tracking.names]
    run = Run(channels)
    run.params({**job_params(spec, site), "hpcdist.git_commit": identity.git_commit})
    # the whole job and site, as the result file keeps them (its spec_json and site_json attributes)
    run.tags({"hpcdist.spec_json": spec.model_dump_json(), "hpcdist.site_json": site.model_dump_json()})
    return run


def report(job: TrackedJob, figures: Mapping[str, Any], result: Path | None = None, step: int = 0) -> None:
    """A job's figures at its end in one go (inference's latency percentiles): logged at `step`,
    the result file as an artifact, the run ended. Rank 0; nothing elsewhere or with no tracker."""
    run = open_run(job.spec, job.site, job.job_id, job.rank)
    if run is None:
        return
    run.metrics(step, dict(figures))
    if result is not None:
        run.artifact(result)
    run.close(finished=True)


def job_params(spec: JobSpec, site: Site) -> dict[str, Any]:
    """What every run records as parameters: the job's kind, site, hpcdist version and its params
    (nested keys joined by dots); the same on every restart (MLflow refuses a changed one)."""
    from hpcdist._version import __version__

    res = spec.resources
    out: dict[str, Any] = {"hpcdist.kind": spec.kind, "hpcdist.site": site.name, "hpcdist.version": __version__,
                           "hpcdist.nodes": res.nodes, "hpcdist.tasks_per_node": res.tasks_per_node}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    walk("params", spec.params)
    return out

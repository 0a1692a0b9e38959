"""The job's MLflow run: metrics by step through ``log_batch``, parameters, tags and artifacts.

MLflow cannot delete a logged point. A restart that resumed a checkpoint older than the last step
sent (a node died; a preemption checkpoints at the step it stopped, so it never does this) logs
those steps again with their new values, which MLflow shows as the latest, and marks the run:
the tag ``hpcdist.replayed_steps`` names each such range.
"""

from __future__ import annotations

import os
import time
from typing import Any

from hpcdist.config.tracking import Identity
from hpcdist.track.base import Item

BATCH = 1000  # MLflow's limit of metrics in one log_batch
TAG_MAX = 8000  # MLflow's limit of a tag's value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, identity: Identity, high_water: int | None, job_id: str):
        self.identity, self.high_water, self.job_id = identity, high_water, job_id
        self.replayed: list[int] = []
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            # fail within seconds when the server is down: the channel tries again, the job never waits
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.identity.mlflow_uri)
            self._client.set_tag(self.identity.mlflow_run_id, "hpcdist.job_id", self.job_id)
        return self._client

    def send(self, items: list[Item]) -> None:
        from mlflow.entities import Metric, Param

        client, run_id = self.client(), self.identity.mlflow_run_id
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, i.step) for i in items if i.what == "metrics" for k, v in i.values.items()]
        params = [Param(k, v) for i in items if i.what == "params" for k, v in i.values.items()]
        self._mark_replayed([i.step for i in items if i.what == "metrics"])  # marked before the second points land
        for start in range(0, max(len(metrics), 1), BATCH):
            client.log_batch(run_id, metrics=metrics[start:start + BATCH], params=params if start == 0 else [])
        for i in items:
            if i.what == "artifact" and i.path is not None and i.path.exists():
                client.log_artifact(run_id, str(i.path))
            elif i.what == "tags":
                for key, value in i.values.items():
                    if len(value) <= TAG_MAX:
                        client.set_tag(run_id, key, value)
                    else:  # MLflow refuses a longer tag: the value whole as a file of the run
                        client.log_text(run_id, value, f"{key}.json")

    def _mark_replayed(self, steps: list[int]) -> None:
        if self.high_water is None:
            return
        again = [s for s in steps if s <= self.high_water]
        if not again:
            return
        self.replayed += again
        lo, hi = min(self.replayed), max(self.replayed)
        self.client().set_tag(self.identity.mlflow_run_id, f"hpcdist.replayed_steps.{self.job_id}",
                              f"{lo}-{hi} (logged again after a restart from an older checkpoint)")

    def finish(self, finished: bool) -> None:
        if finished:
            self.client().set_terminated(self.identity.mlflow_run_id, "FINISHED")

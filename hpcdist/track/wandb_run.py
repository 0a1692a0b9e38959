"""The job's W&B run: one run id for the job (the identity's key), ``resume="allow"``, its files
under the job's tracking folder (``WANDB_DIR``). Offline, W&B cannot resume: each start writes its
own ``offline-run-<time>-<id>`` folder there (wandb never reuses one), all of the one run, synced
in order from the login node by ``hpcdist track sync`` (docs/tracking.md). W&B takes no step that
goes back and cannot rewind offline, so a restart from an older checkpoint leaves out the steps it
took before (their earlier values stay)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from hpcdist.config.tracking import Identity
from hpcdist.track.base import Item


class WandbTracker:
    name = "wandb"

    def __init__(self, identity: Identity, folder: Path, high_water: int | None):
        self.identity, self.folder, self.high_water = identity, folder, high_water
        self._run: Any = None
        self._config: dict[str, Any] = {}

    def run(self) -> Any:
        if self._run is None:
            import wandb

            ident = self.identity
            self._run = wandb.init(
                project=ident.wandb_project, entity=ident.wandb_entity or None, id=ident.key, name=ident.name,
                resume="allow", dir=str(self.folder), mode=cast(Any, ident.wandb_mode), config=self._config,
                settings=wandb.Settings(console="off", silent=True, save_code=False),
            )
        return self._run

    def send(self, items: list[Item]) -> None:
        fresh = self._run is None
        for i in items:
            if i.what in ("params", "tags") and fresh:
                self._config.update(_config(i))  # the run's config, given at init
        run = self.run()
        for i in items:
            if i.what == "metrics" and (self.high_water is None or i.step > self.high_water):
                run.log(i.values, step=i.step)
            elif i.what in ("params", "tags") and not fresh:
                run.config.update(_config(i), allow_val_change=True)
            elif i.what == "artifact" and i.path is not None and i.path.exists():
                run.save(str(i.path), base_path=str(i.path.parent), policy="now")

    def finish(self, finished: bool) -> None:
        if self._run is not None:
            if not finished:
                self._run.mark_preempting()  # W&B's state for a run that a requeue resumes
            self._run.finish()


def _config(item: Item) -> dict[str, Any]:
    """Parameters as they are; tags (JSON) as the values they hold, which W&B shows nested."""
    if item.what != "tags":
        return dict(item.values)
    out: dict[str, Any] = {}
    for key, value in item.values.items():
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out

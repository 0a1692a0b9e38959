"""The job's TensorBoard run: one event-file folder per job (``tensorboard_dir``), written with
torch's ``SummaryWriter``. Every start opens its own event file with ``purge_step`` at the first
step it logs, so what an earlier start logged from that step on is dropped by TensorBoard's reader:
each step once. (An earlier start that wrote no step, its rank 0 killed before its first send, left
no high-water mark to say it was a restart: so the purge is not only for restarts. On a fresh run
nothing is before it to purge.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcdist.config.tracking import tensorboard_dir
from hpcdist.track.base import Item


class TensorboardTracker:
    name = "tensorboard"

    def __init__(self, folder: Path, high_water: int | None):
        self.dir, self.high_water = tensorboard_dir(folder), high_water
        self._writer: Any = None
        self._held: list[Item] = []  # what came before the first step (parameters): written with it

    def writer(self, first_step: int) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir), purge_step=first_step)  # drop what it logs again
        return self._writer

    def send(self, items: list[Item]) -> None:
        metrics = [i for i in items if i.what == "metrics"]
        if self._writer is None and not metrics:
            self._held += items  # opened at its first step, which sets purge_step
            return
        items, self._held = self._held + items, []
        writer = self.writer(metrics[0].step if metrics else 0)
        for i in items:
            if i.what == "metrics":
                for key, value in i.values.items():
                    writer.add_scalar(key, value, i.step)
            elif i.what == "params":
                writer.add_text("hpcdist/params", "```\n" + json.dumps(i.values, indent=1) + "\n```")
            elif i.what == "tags":
                for key, value in i.values.items():
                    writer.add_text(key, "```\n" + value + "\n```")
        writer.flush()

    def finish(self, finished: bool) -> None:
        if self._writer is not None:
            self._writer.close()

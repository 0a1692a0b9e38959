"""The steps since ``train_gpt`` last looked at its numbers, on the node: their losses and gradient
norms stay on the device until the loop logs (every ``params.log_every`` steps, and before a
validation, a checkpoint or a stop), when one reduction over the ranks and one copy to the host
give every step's row.

A step that asked for its loss as a Python number would wait for the GPU each step (the host
could not queue the next step's kernels meanwhile): the plain loop people compare with reads its
loss only when it prints. So a step's row in ``/train/steps`` is the same as before (each step's
loss, mean over ranks, its gradient norm and lr), and its time is the window's: the seconds from
the window's first step to the host's copy at its end, shared evenly by its steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

STOP_CHECK_S = 1.0  # agree on should_stop() at least this often (once a step when steps are slower)


@dataclass
class Window:
    """Steps run since the last flush: each one's (step, epoch, lr, tokens seen) and its loss and
    gradient norm as device tensors (the loss this rank's mean over its micro-batches)."""

    started: float | None = None
    steps: list[tuple[int, int, float, int]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)

    def start(self) -> None:
        """Mark the time a step begins; a window's clock starts at its first step."""
        if self.started is None:
            self.started = time.perf_counter()

    def add(self, step: int, epoch: int, lr: float, tokens_seen: int, loss: torch.Tensor,
            grad_norm: torch.Tensor) -> None:
        self.steps.append((step, epoch, lr, tokens_seen))
        self.losses.append(loss.detach().reshape(()))
        self.norms.append(grad_norm.detach().reshape(()).float())

    def flush(self, world_size: int, tokens_per_step: int) -> tuple[list[dict[str, Any]], float]:
        """Every step's row (``epoch, loss, grad_norm, lr, tokens_per_s, step_time_s, tokens_seen``
        and ``step``), the losses averaged over the ranks (a collective: every rank flushes at the
        same steps); and the mean step time over the ranks, the same number on each. Empties the window."""
        if not self.steps:
            return [], 0.0
        norm_list = torch.stack(self.norms).tolist()  # the host copy waits for the window's last step
        seconds = time.perf_counter() - (self.started or time.perf_counter())
        values = torch.cat([torch.stack(self.losses).float(),
                            torch.tensor([seconds], dtype=torch.float32, device=self.losses[0].device)])
        if world_size > 1:
            dist.all_reduce(values)
        *sums, clock = values.tolist()
        mean_s = clock / world_size / len(self.steps)
        loss_list = [v / world_size for v in sums]
        rows = [{"step": s, "epoch": e, "loss": loss, "grad_norm": norm, "lr": lr,
                 "tokens_per_s": tokens_per_step / mean_s if mean_s > 0 else 0.0, "step_time_s": mean_s,
                 "tokens_seen": seen}
                for (s, e, lr, seen), loss, norm in zip(self.steps, loss_list, norm_list, strict=True)]
        self.started, self.steps, self.losses, self.norms = None, [], [], []
        return rows, mean_s


def stop_every(log_every: int, step_s: float) -> int:
    """How many steps apart the ranks agree on ``should_stop()`` (a collective and a host copy):
    every step when a step takes `STOP_CHECK_S` or more, else about every second, at most
    `log_every` apart. `step_s` must be the same on every rank (``Window.flush``'s mean)."""
    if step_s <= 0:
        return 1
    return max(1, min(log_every, int(STOP_CHECK_S / step_s)))

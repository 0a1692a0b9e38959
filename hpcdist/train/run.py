"""``Run``: everything one rank of ``train_gpt`` trains with, in one object that the loop, the
checkpoint resume and the result writer take (its own module, so they need not import the loop).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hpcdist.data.dataset import DistributedOrder, TokenWindows
from hpcdist.model.gpt import GPT, GPTConfig
from hpcdist.train.metrics import Metrics
from hpcdist.train.params import Precision, TrainParams

if TYPE_CHECKING:
    from hpcdist.api import Context
    from hpcdist.data.tokenizer import Tokenizer
    from hpcdist.runtime.job_rank import JobRank


@dataclass
class Run:
    """Everything one rank trains with; step/epoch/position say where the data order stands."""

    api: Context  # the rank's context: checkpoints, should_stop, requeue, results; ``ctx`` is its job's facts
    params: TrainParams
    cfg: GPTConfig
    model: GPT
    net: nn.Module  # what the steps run: DDP around the model, or the model sharded by FSDP2 (params.parallel)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    order: DistributedOrder
    train: TokenWindows
    val: TokenWindows
    peak_lr: float
    precision: Precision  # what this run uses: params.precision with "auto" resolved for the device
    mixed: bool = False  # FSDP's mixed precision policy casts in place of autocast
    metrics: Metrics = field(default_factory=Metrics)
    step: int = 0
    epoch: int = 0
    position: int = 0
    tokens_seen: int = 0
    last_checkpoint: Path | None = None
    commits_seen: int = 0  # of api.checkpoints.committed, already in the metrics
    tokenizer: Tokenizer | None = None  # the token file's: recorded in every checkpoint
    compile_cache: Path | None = None  # where torch.compile keeps its code; None: the model runs eager
    # whether the model is sharded (FSDP2): its checkpoints are then sharded too. Read once from the
    # frozen params, so the loop, its checkpoint state and its resume read a fact, not a computation
    sharded: bool = field(init=False)

    def __post_init__(self) -> None:
        self.sharded = self.params.parallel.fsdp

    @property
    def ctx(self) -> JobRank:
        """The bootstrap's context of this rank (spec, site, device, timings), the one ``api`` is built on."""
        return self.api.job

    @property
    def requeues(self) -> int:
        """This job's requeues, counting a stop in progress (the API's count: the bound's input)."""
        return self.api.counts_if_requeued().requeues

    @property
    def timeouts(self) -> int:
        return self.api.counts_if_requeued().timeouts

    @property
    def tokens_per_step(self) -> int:
        return self.order.global_batch * self.cfg.context

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        precision = self.precision
        if precision == "fp32" or self.mixed:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.ctx.device.type, dtype=dtype)

"""The ``train_gpt`` job kind: its parameters, checked on the login node before anything launches.

This module stays light (pydantic and the config base models only) because the login node validates specs with
it; the model shape is checked against ``GPTConfig`` and the token file's vocabulary in
``check``, which imports them only when a spec is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from hpcdist.config.site import ExpandedPath, Frozen
from hpcdist.config.spec import SpecPath

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.kinds.registry import Job, Problem


class BatchParams(Frozen):
    micro: int = Field(default=8, ge=1, description="sequences per rank per micro-batch")
    accum: int = Field(default=1, ge=1, description="micro-batches per optimizer step")


class OptimParams(Frozen):
    lr: float = Field(default=6e-4, gt=0, description="peak learning rate at the reference batch")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="final lr as a fraction of the peak")
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float | None = Field(default=1.0, gt=0, description="max global gradient norm; null: no clipping")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        default="none", description="scale lr with global batch / reference_batch"
    )
    reference_batch: int | None = Field(
        default=None, ge=1, description="sequences per step the lr was tuned for (default: one rank's batch)"
    )


class EvalParams(Frozen):
    every: int = Field(default=50, ge=0, description="validate every N steps (0: only at the end)")
    batches: int = Field(default=4, ge=1, description="micro-batches per rank per validation")


class CheckpointParams(Frozen):
    every: int = Field(default=50, ge=1, description="write a checkpoint every N steps")
    keep_last: int = Field(default=2, ge=1, description="committed checkpoints kept")
    resume: bool = Field(default=True, description="resume from the newest good checkpoint")
    if_unusable: Literal["error", "start_fresh"] = Field(
        default="error", description="when checkpoints exist but none verifies"
    )
    background: bool = Field(
        default=True, description="write, hash and commit in a thread: a step waits only for the copy to host memory"
    )
    io_timeout_s: float | None = Field(
        default=None, gt=0, description="how long the other ranks wait for rank 0 to write, verify and commit a "
        "checkpoint, in place of timeout_s (default 1800)",
    )
    checksum: Literal["xxh3-128", "sha256"] | None = Field(
        default=None, description="digest of every checkpoint array (default: the site's storage.checksum)"
    )


class ParallelParams(Frozen):
    """How the ranks split the model, in torchtitan's terms: ``dp_replicate`` copies of the model,
    each sharded over ``dp_shard`` ranks (FSDP2). -1 is what the world size leaves. The default,
    every rank a whole copy, is DDP; ``dp_shard`` other than 1 is FSDP (HSDP with both above 1)."""

    dp_replicate: int = Field(default=-1, description="data-parallel copies of the model (-1: the rest)")
    dp_shard: int = Field(default=1, description="ranks each copy is sharded over by FSDP2 (-1: the rest)")

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        """``parallel: fsdp`` (every rank a shard of one copy) and ``parallel: ddp``."""
        if isinstance(value, str):
            forms = {"ddp": {}, "fsdp": {"dp_replicate": 1, "dp_shard": -1}}
            if value not in forms:
                raise ValueError(f"parallel {value!r} is not a known form; use ddp, fsdp, or a block "
                                 f"{{dp_replicate: N, dp_shard: M}}")
            return forms[value]
        return value

    @model_validator(mode="after")
    def _sizes(self) -> ParallelParams:
        for key in ("dp_replicate", "dp_shard"):
            if getattr(self, key) == 0 or getattr(self, key) < -1:
                raise ValueError(f"{key} {getattr(self, key)} is not a size; use a positive number or -1 (the rest)")
        if self.dp_replicate == self.dp_shard == -1:
            raise ValueError("dp_replicate and dp_shard are both -1; at most one may take the rest of the ranks")
        return self

    @property
    def fsdp(self) -> bool:
        """Whether the model is sharded (FSDP2), at any world size: checkpoints are then sharded too."""
        return self.dp_shard != 1

    def sizes(self, world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) at `world_size`, -1 resolved; a ValueError saying what to set
        when they do not multiply to it."""
        rep, shard = self.dp_replicate, self.dp_shard
        if rep == -1 and world_size % shard == 0:
            rep = world_size // shard
        elif shard == -1 and world_size % rep == 0:
            shard = world_size // rep
        if rep < 1 or shard < 1 or rep * shard != world_size:
            raise ValueError(
                f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} does not make the world size "
                f"{world_size} (nodes x tasks per node); set one of them to -1 or make their product {world_size}"
            )
        return rep, shard


class TrainParams(Frozen):
    data: Annotated[ExpandedPath, SpecPath(hint="make it with `hpcdist data prepare TEXT... -o FILE`")] = Field(
        description="token file from `hpcdist data prepare`")
    model: dict[str, Any] = Field(default_factory=dict, description="GPTConfig fields")
    init: Annotated[ExpandedPath | None, SpecPath(hint="make it with `hpcdist model import DIR -o FILE.h5`")] = Field(
        default=None,
        description="start from this checkpoint's weights (a file or directory, e.g. from `hpcdist model import`) "
        "when there is none to resume; params.model may then set only dropout and, for a rotary model, a "
        "shorter context",
    )
    steps: int = Field(default=100, ge=1, description="optimizer steps of the whole run")
    batch: BatchParams = BatchParams()
    optim: OptimParams = OptimParams()
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto",
        description="auto: bf16 autocast on GPUs that support it, else fp32 (bf16 autocast on a CPU is several "
        "times slower than fp32); fp16 uses a loss scaler and needs GPUs",
    )
    parallel: ParallelParams = Field(
        default=ParallelParams(),
        description="DDP (the default, or `ddp`) or FSDP2 (`fsdp`, or {dp_replicate, dp_shard}): see ParallelParams",
    )
    seed: int = Field(default=1234, ge=0)
    deterministic: bool = Field(
        default=False,
        description="repeatable to the bit on GPUs (a rerun, or a resume, gives the same losses): deterministic "
        "kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG) and attention by SDPA's math "
        "backend, whose backward has no atomics; compiled code too (inductor's deterministic mode: no "
        "autotuning by timing, atomic kernels fall back to torch's deterministic ones); slower. CPU runs are "
        "repeatable without it",
    )
    compile: Literal["auto"] | bool = Field(
        default="auto",
        description="torch.compile each transformer block and the head with its loss (the module DDP or FSDP2 "
        "wraps stays eager); auto: on for GPUs, off for CPUs, where compiling takes longer than it saves. "
        "The first step includes the compilation (the log says how long it took); the compiled code is kept "
        "in the user's scratch (TORCHINDUCTOR_CACHE_DIR, unless set), so a requeue or resubmission reuses it",
    )
    eval: EvalParams = EvalParams()
    checkpoint: CheckpointParams = CheckpointParams()
    log_every: int = Field(default=10, ge=1)
    run_steps: int | None = Field(
        default=None, ge=1, description="stop after this many steps in this run (checkpointed); resume later"
    )
    peak_tflops: float | None = Field(default=None, gt=0, description="per-GPU peak, for model FLOPs utilisation")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_word(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() not in ("auto", "true", "false"):
            raise ValueError(f"{value!r} is not auto, true or false")
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainParams:
        if self.optim.warmup_steps > self.steps:
            raise ValueError(f"optim.warmup_steps {self.optim.warmup_steps} is more than steps {self.steps}")
        return self


def check(job: Job[TrainParams], site: Site) -> list[Problem]:
    """Model shape, token file and precision against the site; each problem names its key."""
    from pydantic import ValidationError

    from hpcdist.data.tokens import describe
    from hpcdist.errors import HpcdistError, JobError

    spec, params = job.spec, job.params
    problems: list[Problem] = []
    try:
        info = describe(params.data)
    except JobError as exc:
        return [("params.data", str(params.data), str(exc))]
    if params.init is not None:
        try:
            from hpcdist.data.tokenizer import mismatch
            from hpcdist.model.checkpoint import checkpoint_tokenizer, read_header
            from hpcdist.store.checkpoint.discovery import resolve

            path = resolve(params.init)
            wrong = mismatch(info.load_tokenizer(), params.data, checkpoint_tokenizer(path, read_header(path).config),
                             path)
            if wrong:
                return [("params.data", str(params.data), wrong)]
        except HpcdistError as exc:
            return [("params.init", str(params.init), str(exc))]
    try:
        cfg = model_config(params, info.vocab_size)
    except HpcdistError as exc:
        return [("params.model", dict(params.model), str(exc))]
    except ValidationError as exc:
        for err in exc.errors():
            key = "params.model." + ".".join(str(p) for p in err["loc"]) if err["loc"] else "params.model"
            value = err.get("input") if err["loc"] else dict(params.model)
            problems.append((key, value, err["msg"].removeprefix("Value error, ")))
        return problems
    if cfg.vocab_size < info.vocab_size:
        problems.append(
            ("params.model.vocab_size", cfg.vocab_size, f"at least {info.vocab_size}, the vocabulary of {params.data}")
        )
    if cfg.sliding_window is not None and cfg.context > cfg.sliding_window:
        problems.append(("params.model.context", cfg.context,
                         f"a training sequence longer than the model's sliding_window of {cfg.sliding_window} needs "
                         f"sliding-window attention, which hpcdist does not implement; set params.model.context to "
                         f"at most {cfg.sliding_window}"))
    try:
        params.parallel.sizes(spec.resources.world_size)
    except ValueError as exc:
        problems.append(("params.parallel", params.parallel.model_dump(), str(exc)))
    if params.precision == "fp16" and params.parallel.fsdp:
        problems.append(("params.precision", "fp16", "FSDP runs without a loss scaler; use bf16 (its mixed "
                         "precision policy on GPUs) or fp32"))
    if params.precision == "fp16" and spec.resources.gpus_per_node == 0:
        problems.append(("params.precision", "fp16", "fp16 with a loss scaler needs GPUs; use bf16 or fp32 on CPUs"))
    samples = (info.lengths["train"] - 1) // cfg.context
    global_batch = spec.resources.world_size * params.batch.micro * params.batch.accum
    if samples < global_batch:
        problems.append(
            (
                "params.batch.micro",
                params.batch.micro,
                f"the training split of {params.data} has {samples} samples of {cfg.context} tokens, fewer "
                f"than one global batch ({global_batch}); use more text, a smaller context or batch",
            )
        )
    if params.eval.every and (info.lengths["val"] - 1) // cfg.context < spec.resources.world_size:
        problems.append(
            (
                "params.eval.every",
                params.eval.every,
                f"{params.data} has too little validation text; set 0 or prepare more",
            )
        )
    return problems


Precision = Literal["fp32", "bf16", "fp16"]


def effective_precision(requested: str, device_type: str, bf16_supported: bool) -> Precision:
    """The precision a run uses on `device_type`: `requested`, with ``auto`` resolved.

    ``auto`` is bf16 autocast on a GPU that supports it (Ampere and newer) and fp32 everywhere
    else: on CPUs bf16 autocast costs more in casts than it saves (7.5x slower for the demo).
    """
    if requested == "auto":
        return "bf16" if device_type == "cuda" and bf16_supported else "fp32"
    if requested not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown precision {requested!r}; use auto, fp32, bf16 or fp16")
    return requested  # type: ignore[return-value]


def effective_compile(requested: Literal["auto"] | bool, device_type: str) -> bool:
    """Whether a run on `device_type` compiles: `requested`, with ``auto`` on for CUDA only."""
    return device_type == "cuda" if requested == "auto" else bool(requested)


def model_config(params: TrainParams, vocab_size: int) -> Any:
    """The GPTConfig for `params`: the vocabulary from the token file unless given; with
    ``params.init``, that checkpoint's model (``params.model`` may change only its dropout and,
    where positions are rotary and so hold no weights, shorten the context: the training sequence)."""
    from hpcdist.model.config import GPTConfig

    if params.init is None:
        return GPTConfig.model_validate({"vocab_size": vocab_size, **params.model})
    from hpcdist.errors import ConfigError
    from hpcdist.model.checkpoint import read_header

    base = read_header(params.init).config
    free = ("dropout", "context") if base.positions == "rope" else ("dropout",)
    changed = {k: v for k, v in params.model.items() if k not in free and getattr(base, k, None) != v}
    if changed:
        raise ConfigError(
            f"params.model {changed} differs from params.init's model {base.model_dump()}; with params.init only "
            f"{' and '.join(free)} may be set"
        )
    if "context" in free and int(params.model.get("context", base.context)) > base.context:
        raise ConfigError(f"params.model.context {params.model['context']} is longer than params.init's context "
                          f"{base.context}; use at most that")
    return GPTConfig.model_validate({**base.model_dump(), **params.model})


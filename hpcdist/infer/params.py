"""The inference job kinds: ``infer_gpt`` (load a checkpoint, generate, measure) and ``broadcast``
(how fast a model of a given size reaches every rank).

Light on purpose (pydantic, h5py only when checking): the login node validates a spec, and
reads the checkpoint's header and the prompt file, before anything launches. The runners live
in ``hpcdist.infer.run``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, NamedTuple

from pydantic import Field, model_validator

from hpcdist.config.site import Frozen
from hpcdist.config.spec import SpecPath
from hpcdist.data.tokenizer import BYTES, ByteTokenizer, FileTokenizer
from hpcdist.errors import HpcdistError
from hpcdist.model.config import GPTConfig

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.kinds.registry import Job, Problem
    from hpcdist.model.checkpoint import CheckpointHeader


class InferParams(Frozen):
    """``infer_gpt``: which checkpoint, which prompts, how it is split and how tokens are chosen."""

    checkpoint: Annotated[str, SpecPath(site_root="checkpoints", hint="run the training job first (it writes "
                                        "storage.checkpoints/<its name>), e.g. in a --chain")] = Field(
        description="a step_*.h5 file or a checkpoint directory (its 'latest' is followed); a relative "
        "path is looked up under your storage.checkpoints first, then beside the spec file if its folder is yours alone"
    )
    prompts: Annotated[str, SpecPath()] = Field(description="prompt file: one prompt per line, or .jsonl")
    model: GPTConfig | None = Field(default=None, description="if given, the checkpoint must hold this model")
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree; the world size must be a multiple")
    load: Literal["broadcast", "shard"] = Field(
        default="broadcast", description="rank 0 reads and broadcasts a bucket at a time (each rank keeps its "
        "shard of it), or each rank reads its own shard"
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="the dtype the model and its KV cache run in; null: the checkpoint's own"
    )
    bucket_mb: float = Field(default=64.0, gt=0, description="what rank 0 reads and broadcasts at a time (the "
                             "largest tensor where bigger); a rank's load peak is its shard plus one bucket")
    verify_received: bool = Field(default=True,
                                  description="each rank checks the shard it keeps against rank 0's hash of it")
    batch_size: int = Field(default=8, ge=1)
    max_new_tokens: int = Field(default=32, ge=1)
    temperature: float = Field(default=0.0, ge=0, description="0 is greedy")
    top_k: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int = 0
    end_token: int | Literal["eot"] | None = Field(
        default="eot",
        description="stop a row at this token id; eot: the checkpoint tokenizer's end of text; null: never",
    )

    @model_validator(mode="after")
    def _end_token_id(self) -> InferParams:
        if isinstance(self.end_token, int) and self.end_token < 0:
            raise ValueError(f"end_token {self.end_token} must be a token id (>= 0), eot or null")
        return self


class Inspected(NamedTuple):
    """What ``inspect`` found: the header, the prompts encoded with the checkpoint's tokenizer,
    the problems, that tokenizer and the end token id (``params.end_token`` resolved)."""

    header: CheckpointHeader | None
    prompts: list[list[int]] | None
    problems: list[Problem]
    tokenizer: ByteTokenizer | FileTokenizer
    end_token: int | None


class BroadcastParams(Frozen):
    """``broadcast``: a model-sized set of tensors from rank 0 to all, timed and checked."""

    model: GPTConfig | None = Field(default=None, description="size the tensors as this model's")
    size_mb: float | None = Field(default=None, gt=0, description="or this many MB in tensors of tensor_mb")
    tensor_mb: float = Field(default=4.0, gt=0)
    bucket_mb: float = Field(default=64.0, ge=0, description="0: one broadcast per tensor")
    iters: int = Field(default=5, ge=1)
    warmup: int = Field(default=1, ge=0)
    min_busbw_gbps: float | None = Field(default=None, ge=0, description="fail when the median is below")

    @model_validator(mode="after")
    def _one_size(self) -> BroadcastParams:
        if (self.model is None) == (self.size_mb is None):
            raise ValueError("give exactly one of model (a GPT config) or size_mb")
        return self


def locate_checkpoint(value: str, site: Site) -> Path:
    """A checkpoint path as the spec loader left it (``hpcdist.kinds.registry.site_relative``):
    absolute, or relative to this user's checkpoint storage (``checkpoint: train_gpt`` is that
    job's checkpoints, your own), never to the folder a rank runs in; a colleague's is named by
    its absolute path."""
    path = Path(value)
    return path if path.is_absolute() else site.storage.root("checkpoints") / path


def inspect(params: InferParams, site: Site, world_size: int) -> Inspected:
    """Read the checkpoint header, its tokenizer and the prompts and list what stops the job,
    before any weight moves."""
    from hpcdist.infer.prompts import load_prompts
    from hpcdist.infer.shard_load import check_tp
    from hpcdist.model.checkpoint import checkpoint_tokenizer, read_header

    problems: list[Problem] = []
    header = None
    tokenizer: ByteTokenizer | FileTokenizer = BYTES
    try:
        header = read_header(locate_checkpoint(params.checkpoint, site), expect=params.model)
        tokenizer = checkpoint_tokenizer(header.path, header.config)
    except HpcdistError as exc:
        problems.append(("params.checkpoint", params.checkpoint, str(exc)))
    end_token = tokenizer.eot_id if params.end_token == "eot" else params.end_token
    cfg = header.config if header is not None else params.model
    if cfg is not None:
        for what, value, todo in check_tp(cfg, params.tp):
            problems.append((f"params.{what}", value, todo))
        if end_token is not None and end_token >= cfg.vocab_size:
            problems.append(("params.end_token", end_token, f"must be below the vocab size {cfg.vocab_size}"))
    if world_size % params.tp:
        problems.append(
            ("params.tp", params.tp, f"must divide the world size {world_size} (nodes x tasks_per_node); "
             f"the ranks beyond tensor parallelism serve prompts data-parallel")
        )
    encoded = None
    try:
        encoded = [tokenizer.encode_text(p) for p in load_prompts(params.prompts)]
    except HpcdistError as exc:
        problems.append(("params.prompts", params.prompts, str(exc)))
    if encoded is not None and cfg is not None:
        for i, ids in enumerate(encoded):
            if len(ids) > cfg.context:
                problems.append(
                    ("params.prompts", f"{params.prompts} prompt {i + 1}",
                     f"is {len(ids)} tokens, longer than the model's context of {cfg.context}; shorten it")
                )
                break
            if len(ids) + params.max_new_tokens - 1 > cfg.context:
                problems.append(
                    ("params.max_new_tokens", params.max_new_tokens,
                     f"prompt {i + 1} ({len(ids)} tokens) plus {params.max_new_tokens} new tokens exceeds the "
                     f"context of {cfg.context}; use at most {cfg.context - len(ids) + 1} or shorten the prompt")
                )
                break
            window = cfg.sliding_window
            if window is not None and len(ids) + params.max_new_tokens - 1 > window:
                problems.append(
                    ("params.max_new_tokens", params.max_new_tokens,
                     f"prompt {i + 1} ({len(ids)} tokens) plus {params.max_new_tokens} new tokens exceeds the model's "
                     f"sliding_window of {window}, which hpcdist does not implement; use at most "
                     f"{max(0, window - len(ids) + 1)} or shorten the prompt")
                )
                break
    return Inspected(header, encoded, problems, tokenizer, end_token)


def check_infer(job: Job[InferParams], site: Site) -> list[Problem]:
    return inspect(job.params, site, job.spec.resources.world_size).problems


def check_broadcast(job: Job[BroadcastParams], site: Site) -> list[Problem]:
    spec = job.spec
    if spec.resources.world_size < 2:
        return [("resources", spec.resources.world_size, "a broadcast needs at least 2 ranks")]
    return []


def problems_text(problems: list[Problem]) -> str:
    return "; ".join(f"{key}: {value!r} {todo}" for key, value, todo in problems)



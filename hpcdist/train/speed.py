"""How fast ``train_gpt``'s steps run, on the node: ``torch.compile`` of the model's parts, TF32
matmuls, the fused AdamW, and where the compiled code is cached.

The plain PyTorch loop people measure against (nanoGPT's) compiles the model, multiplies float32
matrices in TF32 and steps a fused AdamW on GPUs; ``train_gpt`` does the same, so its steps cost
what that loop's do. Compiling is per block and for the head with its loss
(``GPT.compile_parts``), before DDP or FSDP2 wraps the model, as torchtitan does: the wrappers'
hooks still run between blocks. The compiled code goes to ``TORCHINDUCTOR_CACHE_DIR``, by default
the user's own folder in the site's scratch (``hpcdist.runtime.caches``), so a requeued or
resubmitted run loads it instead of compiling again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpcdist.runtime.caches import COMPILE_VAR, use_private

if TYPE_CHECKING:
    from hpcdist.model.gpt import GPT
    from hpcdist.runtime.job_rank import JobRank


def fast_matmuls(device: torch.device) -> None:
    """TF32 for float32 matmuls and convolutions on CUDA (bf16 autocast runs leave only a few
    float32 matmuls; an fp32 run gets the tensor cores). Nothing on CPUs."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def adamw(groups: list[dict[str, Any]], device: torch.device, **options: Any) -> torch.optim.AdamW:
    """AdamW with the fused kernel on CUDA (one launch for every parameter) and the foreach one
    elsewhere; the state it keeps, and so checkpoints, are the same for both."""
    if device.type == "cuda":
        return torch.optim.AdamW(groups, **options, fused=True)
    return torch.optim.AdamW(groups, **options, foreach=True)


def compile_cache(ctx: JobRank) -> Path:
    """The folder inductor caches compiled code in: ``TORCHINDUCTOR_CACHE_DIR`` when the user set
    it, else this user's private folder in the site's scratch, which every rank's bootstrap set
    (``hpcdist.runtime.caches``): a requeue and a resubmission of any job of this user find it there."""
    return use_private(ctx.paths)[COMPILE_VAR]


def compile_model(model: GPT, deterministic: bool) -> None:
    """Compile `model`'s blocks and head in place: the first step then compiles (or loads from the cache)."""
    if deterministic:
        import torch._inductor.config as inductor

        inductor.deterministic = True  # no autotuning by timing: the same kernels every run
    model.compile_parts()

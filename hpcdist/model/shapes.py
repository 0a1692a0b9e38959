"""The shapes a GPT checkpoint's model must have: a config's parameter shapes, those of a
checkpoint as it was read and verified (whole or sharded), and the check between them, which
train_gpt's resume makes on rank 0's verified read before any rank reads a tensor; Hugging Face
imports and inference check their weights against `parameter_shapes` too.

Apart from ``hpcdist.model.checkpoint`` (the `/model` tree written and read back): a resume asks
whether the chosen checkpoint fits before the ranks read it, and restores it after, and each of
those moments enters one module. Only the config is imported at module level: a login node checks without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import CheckpointError
from hpcdist.model.config import GPTConfig

if TYPE_CHECKING:
    from hpcdist.store.checkpoint.single import Checkpoint

MODEL_GROUP = "model"  # the checkpoint's group (or a sharded index's prefix) holding the model's tensors


def parameter_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The stored tensors of a GPT of shape `cfg`, in ``state_dict()`` order (a tied head left out).

    A LayerNorm has a weight and a bias, an RMSNorm a weight only; a learned-position model has
    ``wpe``, a rotary one none; biases are there where the config has them; an untied head is
    ``lm_head.weight``.
    """
    d, h, v = cfg.d_model, cfg.d_hidden, cfg.vocab_size
    q, kv = cfg.n_head * cfg.d_head, cfg.n_kv * cfg.d_head
    fc = h * (2 if cfg.mlp == "swiglu" else 1)

    def norm(name: str) -> dict[str, tuple[int, ...]]:
        return {name + ".weight": (d,), **({name + ".bias": (d,)} if cfg.norm == "layernorm" else {})}

    def linear(name: str, n_out: int, n_in: int, bias: bool) -> dict[str, tuple[int, ...]]:
        return {name + ".weight": (n_out, n_in), **({name + ".bias": (n_out,)} if bias else {})}

    out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (v, d)}
    if cfg.positions == "learned":
        out["transformer.wpe.weight"] = (cfg.context, d)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        out.update(norm(p + "ln_1"))
        out.update(linear(p + "attn.c_attn", q + 2 * kv, d, cfg.attention_bias))
        out.update(linear(p + "attn.c_proj", d, q, cfg.attention_out_bias))
        out.update(norm(p + "ln_2"))
        out.update(linear(p + "mlp.c_fc", fc, d, cfg.mlp_bias))
        out.update(linear(p + "mlp.c_proj", d, h, cfg.mlp_bias))
    out.update(norm("transformer.ln_f"))
    if not cfg.tied:
        out["lm_head.weight"] = (v, d)
    return out


def is_sharded(attrs: Mapping[str, Any]) -> bool:
    """Whether root `attrs` are a sharded checkpoint's index (``hpcdist.store.sharded.layout``'s
    test, without its torch import: the login node reads headers)."""
    return attrs.get("layout") == "sharded"


def shapes_in(checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor in a checkpoint's `/model` group (or a sharded checkpoint's
    ``model`` entries, from the index it holds), as the checkpoint was read and verified."""
    if is_sharded(checkpoint.attrs):
        from hpcdist.store.sharded.layout import read_index, tensors_of

        text = read_index(checkpoint.path, checkpoint)[1]
        return {k: e.size for k, e in tensors_of(text, MODEL_GROUP + ".").items()}
    model = checkpoint.tree.get(MODEL_GROUP, {})
    return {k: tuple(v.shape) for k, v in model.items() if hasattr(v, "shape")}


def check_shapes(path: Path, expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> None:
    """A clear error listing every tensor whose shape (or presence) differs from the model's."""
    problems = []
    for key in sorted(set(expected) | set(found)):
        if key not in found:
            problems.append(f"{key}: missing in checkpoint (model has {list(expected[key])})")
        elif key not in expected:
            problems.append(f"{key}: in checkpoint {list(found[key])} but not in the model")
        elif tuple(expected[key]) != tuple(found[key]):
            problems.append(f"{key}: checkpoint {list(found[key])} vs model {list(expected[key])}")
    if problems:
        shown = "; ".join(problems)
        raise CheckpointError(
            f"{path} was written for a different model shape ({len(problems)} tensor(s) differ): {shown}; "
            f"use the same params.model as the run that wrote it, or a fresh checkpoint directory"
        )

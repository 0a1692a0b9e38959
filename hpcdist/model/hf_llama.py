"""Hugging Face LLaMA, Mistral and Qwen2 in and out: the one owner of the mapping between hpcdist's
GPT (``GPTConfig`` with RMSNorm, rotary positions and the SwiGLU MLP) and transformers'
``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM``.

hpcdist keeps GPT-2's names for every family: q, k and v are one ``attn.c_attn`` (q rows, then
k, then v) and the gate and up projections one ``mlp.c_fc`` (gate rows, then up), so the
tensor-parallel split and the checkpoint layout are the same for all. The weights are used as
stored: transformers' rotary embedding rotates halves of a head, as ``hpcdist.model.rope`` does.

The config is read through transformers' own config class, so a file with version 5's
``rope_parameters`` and an older one with ``rope_theta`` / ``rope_scaling`` read alike; what the
model cannot compute exactly (another rope type, another activation, a partial rotary factor)
is one ``ConfigError`` line, never an approximation. ``hpcdist.model.hf`` dispatches here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from hpcdist.errors import ConfigError
from hpcdist.model.config import GPTConfig, RopeScaling

if TYPE_CHECKING:
    import torch

CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
ROPE_TYPES = ("default", "llama3")
HEAD, WTE = "lm_head.weight", "transformer.wte.weight"
SKIP = ("rotary_emb.inv_freq",)
Family = Literal["llama", "mistral", "qwen2"]  # a buffer older files store


def transformers_module() -> Any:
    """transformers, imported on first use (GPT-2's and the LLaMA family's configs and weights)."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("Hugging Face import and export need transformers: pip install 'hpcdist[hf]'") from exc
    return transformers


def gpt_config(raw: Mapping[str, Any], where: Path) -> GPTConfig:
    """The GPTConfig of a LLaMA-family ``config.json`` (as a dict); a ConfigError naming what does not map."""
    family = cast(Family, str(raw.get("model_type")))
    hf = getattr(transformers_module(), CONFIGS[family]).from_dict(dict(raw))
    if hf.hidden_act != "silu":
        raise ConfigError(f"{where}: hidden_act={hf.hidden_act!r} is not supported; hpcdist's SwiGLU MLP needs silu")
    rp = dict(hf.rope_parameters or {})
    rope_type = str(rp.get("rope_type", rp.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}); "
            f"hpcdist refuses rather than approximates it: use a model with default or llama3 rope scaling"
        )
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor={rp['partial_rotary_factor']} is not supported (only 1.0)")
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(factor=rp["factor"], low_freq_factor=rp["low_freq_factor"],
                              high_freq_factor=rp["high_freq_factor"],
                              original_context=rp.get("original_max_position_embeddings")
                              or hf.max_position_embeddings)
    window = None
    if family == "mistral":
        window = hf.sliding_window
    elif family == "qwen2" and "sliding_attention" in (getattr(hf, "layer_types", None) or []):
        window = hf.sliding_window
    d, heads = int(hf.hidden_size), int(hf.num_attention_heads)
    attention_bias = out_bias = bool(getattr(hf, "attention_bias", False))
    if family == "qwen2":  # biases on q, k and v only
        attention_bias, out_bias = True, False
    try:
        return GPTConfig(
            vocab_size=int(hf.vocab_size), context=int(hf.max_position_embeddings), n_layer=int(hf.num_hidden_layers),
            n_head=heads, d_model=d, mlp="swiglu", d_ff=int(hf.intermediate_size), dropout=0.0,
            ln_eps=float(hf.rms_norm_eps), family=family, norm="rmsnorm", positions="rope",
            rope_theta=float(rp.get("rope_theta", 10000.0)), rope_scaling=scaling,
            n_kv_head=int(hf.num_key_value_heads or heads), head_dim=int(getattr(hf, "head_dim", None) or d // heads),
            tied=bool(hf.tie_word_embeddings), attention_bias=attention_bias, attention_out_bias=out_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)), sliding_window=int(window) if window else None,
        )
    except ValueError as exc:
        raise ConfigError(f"{where}: does not describe a model hpcdist can hold: {exc}") from exc


def hf_config(cfg: GPTConfig, eot_id: int | None = None) -> Any:
    """The transformers config of `cfg` (family llama, mistral or qwen2); `eot_id` is eos and pad.

    Qwen2's window is written for every layer (``max_window_layers`` 0): within the window, the only
    lengths hpcdist runs, that is the same attention as any split of the layers."""
    family = cfg.family
    want = {"llama": (cfg.attention_bias, cfg.attention_bias, cfg.mlp_bias), "mistral": (False, False, False),
            "qwen2": (True, False, False)}[family]
    if (cfg.norm, cfg.positions, cfg.mlp) != ("rmsnorm", "rope", "swiglu") or (
            cfg.attention_bias, cfg.attention_out_bias, cfg.mlp_bias) != want:
        raise ConfigError(
            f"this model (norm {cfg.norm}, positions {cfg.positions}, mlp {cfg.mlp}, biases q/k/v "
            f"{cfg.attention_bias}, out {cfg.attention_out_bias}, mlp {cfg.mlp_bias}) does not map onto "
            f"{CLASSES[family]}; set params.model.family to the architecture it has"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_context)
    end = cfg.vocab_size - 1 if eot_id is None else eot_id
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv,
        max_position_embeddings=cfg.context, rms_norm_eps=cfg.ln_eps, hidden_act="silu", rope_parameters=rope,
        tie_word_embeddings=cfg.tied, eos_token_id=end, pad_token_id=end, architectures=[CLASSES[family]],
        bos_token_id=None,  # not kept: the tokenizer's post-processor adds it; no class default (1) that may be wrong
    )
    if family == "llama":
        kwargs.update(head_dim=cfg.d_head, attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    elif family == "mistral":
        kwargs.update(head_dim=cfg.d_head, sliding_window=cfg.sliding_window)
    else:
        if cfg.d_head != cfg.d_model // cfg.n_head:
            raise ConfigError(f"Qwen2 has no head_dim of its own: head_dim {cfg.d_head} must be d_model / n_head")
        kwargs.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                      max_window_layers=0)
    return getattr(transformers_module(), CONFIGS[family])(**kwargs)


def _parts(cfg: GPTConfig) -> list[tuple[str, list[str]]]:
    """(hpcdist tensor, the transformers tensors concatenated along rows to make it), in state order."""
    out = [(WTE, ["model.embed_tokens.weight"])]
    for i in range(cfg.n_layer):
        p, h = f"transformer.h.{i}.", f"model.layers.{i}."
        out.append((p + "ln_1.weight", [h + "input_layernorm.weight"]))
        for kind, on in (("weight", True), ("bias", cfg.attention_bias)):
            if on:
                out.append((p + f"attn.c_attn.{kind}", [h + f"self_attn.{x}_proj.{kind}" for x in "qkv"]))
        for kind, on in (("weight", True), ("bias", cfg.attention_out_bias)):
            if on:
                out.append((p + f"attn.c_proj.{kind}", [h + f"self_attn.o_proj.{kind}"]))
        out.append((p + "ln_2.weight", [h + "post_attention_layernorm.weight"]))
        for kind, on in (("weight", True), ("bias", cfg.mlp_bias)):
            if on:
                out.append((p + f"mlp.c_fc.{kind}", [h + f"mlp.gate_proj.{kind}", h + f"mlp.up_proj.{kind}"]))
                out.append((p + f"mlp.c_proj.{kind}", [h + f"mlp.down_proj.{kind}"]))
    out.append(("transformer.ln_f.weight", ["model.norm.weight"]))
    if not cfg.tied:
        out.append((HEAD, [HEAD]))
    return out


def _split_sizes(key: str, cfg: GPTConfig) -> list[int]:
    if ".attn.c_attn." in key:
        q, kv = cfg.n_head * cfg.d_head, cfg.n_kv * cfg.d_head
        return [q, kv, kv]
    if ".mlp.c_fc." in key:
        return [cfg.d_hidden, cfg.d_hidden]
    return []


def to_hf_state(cfg: GPTConfig, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """transformers' tensors for a GPT state dict: c_attn and c_fc split apart, each in its dtype."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for key, names in _parts(cfg):
        t = torch.as_tensor(state[key]).detach()
        pieces = t.split(_split_sizes(key, cfg), dim=0) if len(names) > 1 else (t,)
        out.update({n: p.clone().contiguous() for n, p in zip(names, pieces, strict=True)})
    if cfg.tied:
        out[HEAD] = out["model.embed_tokens.weight"]
    return out


def from_hf_state(hf_state: Mapping[str, torch.Tensor], cfg: GPTConfig, where: Path) -> dict[str, torch.Tensor]:
    """A GPT state dict from transformers' tensors, each in the dtype the file has (bf16 stays bf16;
    the model computes in float32); a ConfigError listing every missing, unexpected or wrongly
    shaped tensor."""
    import torch

    from hpcdist.model.shapes import parameter_shapes

    got = {k: v for k, v in hf_state.items() if not k.endswith(SKIP)}
    parts = _parts(cfg)
    used = {n for _, names in parts for n in names} | ({HEAD} if cfg.tied else set())
    problems = [f"{n} missing" for _, names in parts for n in names if n not in got]
    problems += [f"{k} unexpected" for k in got if k not in used]
    want = parameter_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    if not problems:
        for key, names in parts:
            t = torch.cat([got[n].detach() for n in names], dim=0).contiguous()
            if tuple(t.shape) != want[key]:
                problems.append(f"{' + '.join(names)} has shape {list(t.shape)}, config.json says {list(want[key])}")
            state[key] = t
    if problems:
        more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ConfigError(
            f"{where}: the weights do not match config.json ({len(problems)} problem(s)): "
            f"{'; '.join(problems[:8])}{more}; save the model again with save_pretrained"
        )
    if cfg.tied:
        if HEAD in got and not torch.equal(got[HEAD].to(state[WTE].dtype), state[WTE]):
            raise ConfigError(f"{where}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
        state[HEAD] = state[WTE]
    return state


def to_hf(cfg: GPTConfig, state: Mapping[str, Any], eot_id: int | None = None) -> Any:
    """The transformers model of `cfg`'s family in eval mode, holding `state` (a GPT state dict)."""
    transformers = transformers_module()
    model = getattr(transformers, CLASSES[cfg.family])(hf_config(cfg, eot_id))
    missing, unexpected = model.load_state_dict(to_hf_state(cfg, state), strict=False)
    missing = [k for k in missing if not (cfg.tied and k == HEAD)]
    if missing or unexpected:
        raise ConfigError(f"weights do not map onto {CLASSES[cfg.family]}: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    if cfg.tied:
        model.tie_weights()
    return model.eval()

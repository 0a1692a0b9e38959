"""Hugging Face models in and out: GPT-2 here (the one owner of the mapping between hpcdist's GPT and
``transformers.GPT2LMHeadModel``; DialoGPT is the same class), LLaMA, Mistral and Qwen2 in
``hpcdist.model.hf_llama``; the folders, weights and tokenizers of all of them here.

The parameter names are GPT-2's already; GPT-2's Conv1D stores its weights as (in, out), the
transpose of ``nn.Linear``, and its head is tied to the token embedding (stored once by both).
Only the GELU MLP maps onto GPT-2 (SwiGLU has no GPT-2 counterpart).

- `import_pretrained`: a ``save_pretrained`` folder (config.json, model.safetensors or
  pytorch_model.bin, sharded or not, and its tokenizer files) to an hpcdist checkpoint carrying
  the tokenizer and its chat template, written atomically with every tensor's sha256
  (``hpcdist model import``);
- `export_pretrained`: a checkpoint to a folder ``from_pretrained`` loads (``hpcdist model export``),
  each tensor in the dtype the checkpoint keeps it in (a bf16 import exports as bf16, bit for bit);
- `to_hf`: the same weights as a transformers model of the config's family, the reference the
  inference tests compare with.

Weights are read by ``safetensors`` / ``torch.load(weights_only=True)`` and configs and tokenizers
by ``transformers``; nothing is downloaded. Weights keep their dtype (bf16 stays bf16 in the
checkpoint); models compute in float32. Every bad input is one ``ConfigError`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import ConfigError
from hpcdist.model.config import GPTConfig
from hpcdist.model.hf_llama import transformers_module

if TYPE_CHECKING:
    import torch

    from hpcdist.data.tokenizer import ByteTokenizer, FileTokenizer
    from hpcdist.model.checkpoint import ChatTemplate

GPT2 = ("GPT2LMHeadModel",)
SUPPORTED = (*GPT2, "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")  # architectures import reads
LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # the same function, GPT-2's and hpcdist's GELU
HEAD, WTE = "lm_head.weight", "transformer.wte.weight"
BUFFERS = (".attn.bias", ".attn.masked_bias")  # older GPT-2 files store the causal mask
# GPT-2's published sizes (vocabulary 50257, context 1024), for benchmarks and examples sized like them
SIZES = {
    name: GPTConfig(vocab_size=50257, context=1024, n_layer=layers, n_head=heads, d_model=d)
    for name, layers, heads, d in (("gpt2-small", 12, 12, 768), ("gpt2-medium", 24, 16, 1024),
                                   ("gpt2-large", 36, 20, 1280), ("gpt2-xl", 48, 25, 1600))
}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


# ---------------------------------------------------------------- configs


def hf_config(cfg: GPTConfig, eot_id: int | None = None) -> Any:
    """The transformers config of `cfg` (``GPT2Config`` for GPT-2); `eot_id` (default the last id) is
    bos, eos and pad."""
    if cfg.family != "gpt2":
        from hpcdist.model import hf_llama

        return hf_llama.hf_config(cfg, eot_id)
    if cfg.mlp != "gelu":
        raise ConfigError(f"only the gelu MLP maps onto GPT-2, not params.model.mlp={cfg.mlp!r}")
    if (cfg.norm, cfg.positions) != ("layernorm", "learned") or cfg.n_kv != cfg.n_head \
            or not (cfg.tied and cfg.attention_bias and cfg.attention_out_bias and cfg.mlp_bias) \
            or cfg.d_head * cfg.n_head != cfg.d_model:
        raise ConfigError(
            f"this model does not map onto GPT-2 (mlp {cfg.mlp}, norm {cfg.norm}, positions {cfg.positions}, "
            f"n_kv_head {cfg.n_kv}, tied {cfg.tied}); set params.model.family to the architecture it has"
        )
    end = cfg.vocab_size - 1 if eot_id is None else eot_id
    return transformers_module().GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.context, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=cfg.d_hidden, activation_function="gelu_new", layer_norm_epsilon=cfg.ln_eps,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, tie_word_embeddings=True,
        bos_token_id=end, eos_token_id=end, pad_token_id=end, architectures=list(GPT2),
    )


def gpt_config(raw: Mapping[str, Any], where: Path) -> GPTConfig:
    """The GPTConfig of a ``config.json`` (as a dict); a ConfigError naming what does not map."""
    archs = list(raw.get("architectures") or [])
    model_type = raw.get("model_type")
    family_class = GPT2[0] if model_type == "gpt2" else LLAMA_FAMILY.get(str(model_type))
    if family_class is None or any(a != family_class for a in archs):
        found = ", ".join(archs) or f"model_type {model_type!r}"
        raise ConfigError(
            f"{where}: architecture {found} is not supported; supported: {', '.join(SUPPORTED)} "
            f"(GPT-2 and DialoGPT, Llama 2/3, Mistral, Qwen2/2.5)"
        )
    if model_type != "gpt2":
        from hpcdist.model import hf_llama

        return hf_llama.gpt_config(raw, where)
    hf = transformers_module().GPT2Config.from_dict(dict(raw))
    flags = [
        ("activation_function", hf.activation_function, hf.activation_function in GELU_TANH, " or ".join(GELU_TANH)),
        ("scale_attn_weights", hf.scale_attn_weights, hf.scale_attn_weights, "true"),
        ("scale_attn_by_inverse_layer_idx", hf.scale_attn_by_inverse_layer_idx,
         not hf.scale_attn_by_inverse_layer_idx, "false"),
        ("add_cross_attention", hf.add_cross_attention, not hf.add_cross_attention, "false"),
        ("tie_word_embeddings", hf.tie_word_embeddings, hf.tie_word_embeddings, "true"),
    ]
    bad = [f"{k}={v!r} (hpcdist's GPT needs {want})" for k, v, ok, want in flags if not ok]
    if bad:
        raise ConfigError(f"{where}: {'; '.join(bad)}; this GPT-2 variant does not map onto hpcdist's GPT")
    d = int(hf.n_embd)
    inner = int(hf.n_inner or 4 * d)
    try:
        cfg = GPTConfig(
            vocab_size=int(hf.vocab_size), context=int(hf.n_positions), n_layer=int(hf.n_layer),
            n_head=int(hf.n_head), d_model=d, mlp="gelu", mlp_ratio=inner / d, dropout=0.0,
            ln_eps=float(hf.layer_norm_epsilon),
        )
    except ValueError as exc:
        raise ConfigError(f"{where}: does not describe a valid GPT: {exc}") from exc
    if cfg.d_hidden != inner:
        raise ConfigError(f"{where}: n_inner={inner} is not a size hpcdist's GPT can hold (n_embd={d})")
    return cfg


# ---------------------------------------------------------------- state dicts


def to_hf_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """GPT-2 tensors for a GPT state dict, each in its dtype: Conv1D weights transposed, the tied head left out."""
    import torch

    out = {}
    for key, value in state.items():
        if key == HEAD:
            continue
        t = torch.as_tensor(value).detach()
        out[key] = t.t().contiguous() if key.endswith(CONV1D) else t.clone()
    return out


def from_hf_state(hf_state: Mapping[str, torch.Tensor], cfg: GPTConfig, where: Path) -> dict[str, torch.Tensor]:
    """A GPT state dict (``lm_head.weight`` the same tensor as the embedding) from GPT-2's tensors,
    each in the dtype the file has; a ConfigError listing every missing, unexpected or wrongly
    shaped tensor."""
    import torch

    from hpcdist.model.shapes import parameter_shapes

    if cfg.family != "gpt2":
        from hpcdist.model import hf_llama

        return hf_llama.from_hf_state(hf_state, cfg, where)

    got: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        if key.endswith(BUFFERS):
            continue
        name = key if key.startswith("transformer.") or key == HEAD else "transformer." + key  # GPT2Model files
        got[name] = value
    want = parameter_shapes(cfg)
    problems = [f"{k} missing" for k in want if k not in got]
    problems += [f"{k} unexpected" for k in got if k not in want and k != HEAD]
    for key, shape in want.items():
        if key in got:
            hf_shape = shape[::-1] if key.endswith(CONV1D) else shape
            if tuple(got[key].shape) != hf_shape:
                problems.append(f"{key} has shape {list(got[key].shape)}, config.json says {list(hf_shape)}")
    if problems:
        more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ConfigError(
            f"{where}: the weights do not match config.json ({len(problems)} problem(s)): "
            f"{'; '.join(problems[:8])}{more}; save the model again with save_pretrained"
        )
    state = {}
    for key in want:
        t = got[key].detach()
        state[key] = (t.t() if key.endswith(CONV1D) else t).contiguous()
    if HEAD in got and not torch.equal(got[HEAD].to(state[WTE].dtype), state[WTE]):
        raise ConfigError(f"{where}: lm_head.weight differs from the token embedding; an untied head is not supported")
    state[HEAD] = state[WTE]
    return state


def to_hf(cfg: GPTConfig, state: Mapping[str, Any], eot_id: int | None = None) -> Any:
    """The transformers model (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) of `cfg`'s family in eval
    mode, holding `state` (a GPT state dict, tensors or arrays)."""
    if cfg.family != "gpt2":
        from hpcdist.model import hf_llama

        return hf_llama.to_hf(cfg, state, eot_id)
    transformers = transformers_module()
    model = transformers.GPT2LMHeadModel(hf_config(cfg, eot_id))
    missing, unexpected = model.load_state_dict(to_hf_state(state), strict=False)
    real_missing = [k for k in missing if k != HEAD and not k.endswith(BUFFERS)]
    if real_missing or unexpected:
        raise ConfigError(f"weights do not map onto GPT-2: missing {real_missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval()


def as_stored(model: Any, cfg: GPTConfig, state: Mapping[str, Any]) -> Any:
    """`model` (`to_hf`'s, float32) with each parameter in the dtype `state` holds it in, so an imported
    bf16 model exports as bf16, bit for bit (bf16 to float32 and back is exact)."""
    if cfg.family != "gpt2":
        from hpcdist.model import hf_llama

        stored = hf_llama.to_hf_state(cfg, state)
    else:
        stored = to_hf_state(state)
    for name, param in model.named_parameters():
        if name in stored and stored[name].dtype != param.dtype:
            param.data = param.data.to(stored[name].dtype)
    return model


# ---------------------------------------------------------------- folders


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` folder, through safetensors or torch (weights only)."""
    import torch

    names = [n for n in WEIGHT_FILES if (directory / n).is_file()]
    if not names:
        raise ConfigError(f"{directory} has no weights: expected one of {', '.join(WEIGHT_FILES)}")
    first = directory / names[0]
    files = [first]
    if first.name.endswith(".index.json"):
        weight_map = json.loads(first.read_text())["weight_map"]
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                state.update(load_file(str(file)))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - each library raises its own kinds for a bad file
            raise ConfigError(f"{file} cannot be read as weights: {exc}") from exc
    return state


@dataclass(frozen=True)
class Imported:
    path: Path
    config: GPTConfig
    tokenizer: str
    parameters: int
    chat_template: bool = False
    dtype: str = "float32"  # the dtype(s) the weights are stored in, as the folder had them


def read_chat_template(directory: Path) -> ChatTemplate | None:
    """The folder's chat template as transformers reads it: chat_template.jinja with named ones in
    additional_chat_templates/ (transformers 4.5x and 5), else tokenizer_config.json's, one template
    or named ones (a list of {name, template}); named templates come as {name: template}."""
    jinja = directory / "chat_template.jinja"
    named = {p.stem: p.read_text(encoding="utf-8")
             for p in sorted((directory / "additional_chat_templates").glob("*.jinja"))}
    if jinja.is_file():
        default = jinja.read_text(encoding="utf-8")
        return {"default": default, **named} if named else default
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return named or None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config} cannot be read as JSON: {exc}") from exc
    if template is None or isinstance(template, str):
        return template
    try:
        pairs = template.items() if isinstance(template, dict) else ((t["name"], t["template"]) for t in template)
        return {str(name): str(text) for name, text in pairs}
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{config}: chat_template is neither a template nor a list of {{name, template}}; "
                          f"save the tokenizer again with save_pretrained") from exc


def read_pretrained(directory: Path) -> tuple[GPTConfig, dict[str, torch.Tensor], ByteTokenizer | FileTokenizer]:
    """The model config, GPT state dict and tokenizer of a ``save_pretrained`` folder, all checked."""
    from hpcdist.data.tokenizer import from_pretrained_dir
    from hpcdist.errors import JobError

    directory = Path(directory)
    config_file = directory / "config.json"
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a folder; give the folder save_pretrained wrote")
    if not config_file.is_file():
        raise ConfigError(f"{directory} has no config.json; give the folder save_pretrained wrote")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config_file} cannot be read as JSON: {exc}") from exc
    cfg = gpt_config(raw, config_file)
    try:  # before the weights: a tokenizer that cannot be read fails at once
        tok = from_pretrained_dir(directory)
    except JobError as exc:
        raise ConfigError(str(exc)) from exc
    state = from_hf_state(read_weights(directory), cfg, directory)
    # LLaMA-family vocabularies may be padded past the tokenizer's (Qwen2: 151936 for 151665 ids)
    if tok.vocab_size > cfg.vocab_size or (cfg.family == "gpt2" and tok.vocab_size != cfg.vocab_size):
        raise ConfigError(
            f"{directory}: the tokenizer has {tok.vocab_size} ids but the model's vocab_size is {cfg.vocab_size}; "
            f"save the model's own tokenizer into the folder"
        )
    return cfg, state, tok


def import_pretrained(directory: Path, out: Path) -> Imported:
    """Write the model and tokenizer of `directory` as an hpcdist checkpoint: the file `out`
    (``*.h5``) or, for any other name, the checkpoint directory `out` (its step 0)."""
    from hpcdist.files.atomic import fsync_path
    from hpcdist.model.checkpoint import write_checkpoint

    cfg, state, tok = read_pretrained(Path(directory))
    template = read_chat_template(Path(directory))
    out = Path(out)
    if out.suffix != ".h5":
        path = write_checkpoint(out, 0, state, cfg, tokenizer=tok, chat_template=template)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:  # the store commits step_0.h5 atomically; one rename in the same directory makes it `out`
            os.replace(write_checkpoint(staging, 0, state, cfg, tokenizer=tok, chat_template=template), out)
            fsync_path(out.parent)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        path = out
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    return Imported(path, cfg, tok.name, cfg.num_params(), template is not None, "/".join(dtypes))


def export_pretrained(checkpoint: Path, out: Path) -> tuple[Path, ByteTokenizer | FileTokenizer]:
    """A folder `out` that ``from_pretrained`` loads: the checkpoint's weights (safetensors) and
    its tokenizer (a ``tokenizers`` one; the byte tokenizer has no such form and is left out)."""
    from hpcdist.data.tokenizer import FileTokenizer
    from hpcdist.model.checkpoint import checkpoint_chat_template, checkpoint_tokenizer, load_model_state
    from hpcdist.store.checkpoint.discovery import resolve

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty folder; give a new folder")
    path = resolve(checkpoint)
    cfg, state = load_model_state(path)
    tok = checkpoint_tokenizer(path, cfg)
    model = as_stored(to_hf(cfg, state, tok.eot_id), cfg, state)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        if isinstance(tok, FileTokenizer):
            import tokenizers

            specials = ({"bos_token": tok.eot_token, "unk_token": tok.eot_token} if cfg.family == "gpt2" else {})
            fast = transformers_module().PreTrainedTokenizerFast(
                tokenizer_object=tokenizers.Tokenizer.from_str(tok.json), eos_token=tok.eot_token,
                chat_template=checkpoint_chat_template(path), **specials,
            )
            fast.save_pretrained(str(staging))
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, tok

"""What is GPT-specific about checkpoints, on top of the model-agnostic ``hpcdist.store``.

In a ``hpcdist.checkpoint`` file the GPT adds:

- the root attribute ``model_config_json`` (``GPTConfig.model_dump_json()``);
- the group ``/model``: one C-order dataset per ``GPT.state_dict()`` key, with the exact key names
  (each with its digest, as every store dataset), in the tensor's own dtype: float32 as
  training writes it, bfloat16 or float16 as an imported model has it (bf16 stays bf16; the store
  keeps a dtype NumPy lacks as its bits with the dataset attribute ``torch_dtype``, see
  ``hpcdist.store.checkpoint.tree``); every reader computes in float32. A tied head ``lm_head.weight``
  (GPT-2's; an untied one is stored as itself) is ``transformer.wte.weight`` and stored once:
  the group attribute ``tied_json`` maps each omitted key to the stored one;
- the group ``/tokenizer`` (``hpcdist.data.tokenizer``): the tokenizer the model reads and
  writes, which inference encodes prompts and decodes outputs with. A checkpoint from before it
  travelled has none: it is taken as bytes when the vocabulary is the byte tokenizer's. An
  imported model's chat template travels in it too: ``chat_template_utf8`` (one Jinja template)
  or ``chat_templates_json_utf8`` (named ones, ``{"default": ..., "tool_use": ...}``), UTF-8 bytes.

Here: the `/model` tree of a state dict and the state dict of a `/model` tree (the one tied-weight
restore), and the header reader inference runs on the login node. The shapes a checkpoint's model
must have, and training's check of them before resuming, are in ``hpcdist.model.shapes``. Only
pydantic, NumPy and h5py are imported at module level, so a login node checks a checkpoint against a spec
without torch; torch is imported where tensors are made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.errors import CheckpointError
from hpcdist.model.config import GPTConfig
from hpcdist.model.shapes import MODEL_GROUP, is_sharded, parameter_shapes
from hpcdist.store import checksum
from hpcdist.store.checkpoint import single as store
from hpcdist.store.checkpoint.discovery import resolve
from hpcdist.store.checkpoint.tree import ChecksumError, DatasetInfo, Tree, as_tensor, is_bits

if TYPE_CHECKING:
    import torch

    from hpcdist.data.tokenizer import ByteTokenizer, FileTokenizer
    from hpcdist.store.sharded.layout import Piece

CONFIG_ATTR = "model_config_json"
TIED_ATTR = "tied_json"
CHAT_TEMPLATE = "chat_template_utf8"  # in the tokenizer group: the Jinja chat template, UTF-8 bytes
CHAT_TEMPLATES = "chat_templates_json_utf8"  # or named ones ({"default": ..., "tool_use": ...}), as UTF-8 JSON
ChatTemplate = str | dict[str, str]  # one Jinja template, or templates by name
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes a model tensor is stored in, and their sizes


def model_attrs(cfg: GPTConfig) -> dict[str, str]:
    """The root attributes the GPT adds to a checkpoint."""
    return {CONFIG_ATTR: cfg.model_dump_json()}


def model_tree(state_dict: Mapping[str, Any]) -> Tree:
    """`/model` for a state dict: each tensor in its dtype when it is one of `DTYPES` (else as
    float32), a NumPy array where NumPy has the dtype, tied tensors stored once (``tied_json``)."""
    out: Tree = {}
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    for key, value in state_dict.items():
        ident = (value.data_ptr(), tuple(value.shape)) if hasattr(value, "data_ptr") else None
        if ident is not None and ident in seen:
            tied[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        if not hasattr(value, "detach"):
            out[key] = np.ascontiguousarray(value, dtype=np.float32)
            continue
        t = value.detach()
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            t, name = t.float(), "float32"
        if t.device.type != "cpu":  # one copy to the host, by the store (a background save's, into reused buffers)
            out[key] = t.contiguous()
            continue
        # an array where NumPy has the dtype, as before; a bfloat16 tensor the store keeps as its bits
        out[key] = t.contiguous() if is_bits(name) else np.ascontiguousarray(t.numpy())
    out[TIED_ATTR] = json.dumps(tied)
    return out


def state_dict_of(group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A state dict for ``GPT.load_state_dict`` (strict) from a `/model` tree as the store reads it,
    each tensor in its stored dtype (``load_state_dict`` copies it into the model's float32).

    Tied keys omitted in the file (``lm_head.weight``) are restored as the same tensor as the
    key they are tied to.
    """
    tied = json.loads(group.get(TIED_ATTR, "{}") or "{}")
    state = {k: as_tensor(v) for k, v in group.items() if hasattr(v, "shape")}
    for key, source in tied.items():
        state[key] = state[source]
    return state


def write_checkpoint(
    directory: str | Path, step: int, state: Mapping[str, Any], cfg: GPTConfig, epoch: int = 0,
    tokenizer: ByteTokenizer | FileTokenizer | None = None, chat_template: ChatTemplate | None = None,
) -> Path:
    """Write `state` (a GPT ``state_dict()``) and its tokenizer (with its chat template, when it has
    one) as a model-only checkpoint and commit it."""
    from hpcdist.data.tokenizer import GROUP

    tree: dict[str, Any] = {MODEL_GROUP: model_tree(state)}
    if tokenizer is not None:
        tree[GROUP] = tokenizer.to_tree()
        if chat_template is not None:
            name, text = ((CHAT_TEMPLATE, chat_template) if isinstance(chat_template, str)
                          else (CHAT_TEMPLATES, json.dumps(chat_template)))
            tree[GROUP][name] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return store.save(Path(directory), step, tree, epoch=epoch, attrs=model_attrs(cfg)).path


def checkpoint_tokenizer(path: Path, cfg: GPTConfig) -> ByteTokenizer | FileTokenizer:
    """The tokenizer checkpoint `path` carries, checked against its model's vocabulary."""
    from hpcdist.data.tokenizer import BYTES, GROUP, from_tree
    from hpcdist.errors import JobError

    try:
        group = store.read(path, groups=(GROUP,), verify=True).tree.get(GROUP)
    except JobError as exc:
        raise CheckpointError(str(exc)) from exc
    if group is None:
        if cfg.vocab_size == BYTES.vocab_size:
            return BYTES
        raise CheckpointError(
            f"checkpoint {path} records no tokenizer and its vocabulary ({cfg.vocab_size}) is not the byte "
            f"tokenizer's; write it again with this hpcdist (train_gpt or `hpcdist model import`)"
        )
    try:
        tok = from_tree(group, str(path))
    except JobError as exc:
        raise CheckpointError(str(exc)) from exc
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(
            f"checkpoint {path}: its tokenizer {tok.name} has {tok.vocab_size} ids, more than the model's "
            f"vocab_size {cfg.vocab_size}; the checkpoint is inconsistent"
        )
    return tok


def checkpoint_chat_template(path: Path) -> ChatTemplate | None:
    """The chat template (or named templates) travelling with the checkpoint's tokenizer; None when it has none."""
    from hpcdist.data.tokenizer import GROUP

    group = store.read(path, groups=(GROUP,), verify=True).tree.get(GROUP) or {}
    for name in (CHAT_TEMPLATE, CHAT_TEMPLATES):
        if (raw := group.get(name)) is not None:
            text = np.ascontiguousarray(raw, dtype=np.uint8).tobytes().decode("utf-8")
            return text if name == CHAT_TEMPLATE else dict(json.loads(text))
    return None


def load_model_state(path: Path, verify: bool = True) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The model config and a state dict ready for ``GPT.load_state_dict`` (strict); from a sharded
    checkpoint (FSDP's, ``hpcdist.store.sharded.checkpoint``) its ``model`` tensors whole, always verified."""
    header = store.read_header(path, MODEL_GROUP)
    if is_sharded(header.attrs):
        return _sharded_model_state(path, header.attrs)
    ckpt = store.read(path, groups=(MODEL_GROUP,), verify=verify)
    if MODEL_GROUP not in ckpt.tree:
        raise CheckpointError(f"{path}: has no /{MODEL_GROUP} group")
    return GPTConfig.model_validate_json(ckpt.attrs[CONFIG_ATTR]), state_dict_of(ckpt.tree[MODEL_GROUP])


def _sharded_model_state(path: Path, attrs: Mapping[str, Any]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """`load_model_state` of a sharded checkpoint: its ``model`` entries only are read; a tied head,
    saved once as the embedding, is restored as it."""
    cfg = GPTConfig.model_validate_json(str(attrs[CONFIG_ATTR]))
    state = _sharded_model(path)
    if cfg.tied:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return cfg, state


def _sharded_model(path: Path) -> dict[str, torch.Tensor]:
    """The ``model`` entries of a sharded checkpoint, whole, every chunk verified."""
    from hpcdist.store.sharded.checkpoint import read_full

    state: dict[str, torch.Tensor] | None = read_full(path, keys=[MODEL_GROUP]).get(MODEL_GROUP)
    if not state:
        raise CheckpointError(f"{path}: the sharded checkpoint has no {MODEL_GROUP} entries")
    return state


# ---------------------------------------------------------------- inference: header, then weights


@dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint holds, read without touching the weights."""

    path: Path
    step: int
    epoch: int
    config: GPTConfig
    shapes: dict[str, tuple[int, ...]]
    digests: dict[str, str]  # each tensor's recorded digest; empty for a sharded checkpoint (one per chunk: `pieces`)
    dtypes: dict[str, str]  # each tensor's stored dtype, one of `DTYPES` ("bfloat16")
    pieces: dict[str, list[Piece]] | None = None  # a sharded checkpoint's (FSDP's): each tensor's saved chunks

    @property
    def sharded(self) -> bool:
        return self.pieces is not None

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * DTYPES[self.dtypes[k]] for k, s in self.shapes.items())


def _config_differences(expect: GPTConfig, cfg: GPTConfig) -> str:
    diff = [(k, getattr(expect, k), getattr(cfg, k)) for k in GPTConfig.model_fields]
    return ", ".join(f"{k}: spec {a!r} vs checkpoint {b!r}" for k, a, b in diff if a != b)


def read_header(path: str | Path, expect: GPTConfig | None = None) -> CheckpointHeader:
    """The header of the checkpoint at `path` (a file, or a directory's committed one), checked for
    format, version, names, shapes, dtypes, checksums present and, when given, the model `expect`."""
    header = store.read_header(resolve(path), MODEL_GROUP)
    file = header.path
    pieces: dict[str, list[Piece]] | None = None
    found: Mapping[str, DatasetInfo] | None = header.datasets
    if is_sharded(header.attrs):  # FSDP's: the model's tensors described by the index, their chunks in shard files
        pieces, found = _sharded_tensors(file)
    try:
        cfg = GPTConfig.model_validate_json(str(header.attrs[CONFIG_ATTR]))
    except Exception as exc:  # noqa: BLE001 - any parse failure is a damaged header
        raise CheckpointError(f"{file}: {CONFIG_ATTR} is missing or invalid ({exc})") from exc
    if found is None:
        raise CheckpointError(f"{file} has no /{MODEL_GROUP} group; the checkpoint is damaged")
    if expect is not None and expect != cfg:
        raise CheckpointError(
            f"checkpoint {file} does not match the model in the spec ({_config_differences(expect, cfg)}); "
            f"fix params.model or drop it to take the checkpoint's"
        )
    want = parameter_shapes(cfg)

    def digests(key: str, info: DatasetInfo) -> list[str]:  # a sharded tensor's: one per chunk
        return [p.chunk.digest for p in pieces.get(key, [])] if pieces is not None else [info.digest]

    for what, items in (
        ("is missing tensors", [k for k in want if k not in found]),
        ("has tensors the model does not", [k for k in found if k not in want]),
        ("has tensors of the wrong shape",
         [f"{k} {found[k].shape} (expected {s})" for k, s in want.items() if k in found and found[k].shape != s]),
        (f"has tensors not in {', '.join(DTYPES)}",
         [f"{k} ({d.dtype_name})" for k, d in found.items() if d.dtype_name not in DTYPES]),
        ("has tensors without a checksum",
         [k for k, d in found.items() if not all(checksum.is_digest(h) for h in digests(k, d))]),
    ):
        if items:
            more = f" and {len(items) - 3} more" if len(items) > 3 else ""
            raise CheckpointError(
                f"checkpoint {file} {what} for its {CONFIG_ATTR}: {', '.join(items[:3])}{more}; "
                f"it was not written by this model"
            )
    return CheckpointHeader(
        path=file,
        step=int(header.attrs["step"]),
        epoch=int(header.attrs["epoch"]),
        config=cfg,
        shapes={k: found[k].shape for k in want},
        digests={} if pieces is not None else {k: found[k].digest for k in want},
        dtypes={k: found[k].dtype_name for k in want},
        pieces=None if pieces is None else {k: pieces[k] for k in want},
    )


def _sharded_tensors(file: Path) -> tuple[dict[str, list[Piece]], dict[str, DatasetInfo] | None]:
    """The ``model`` tensors of the sharded checkpoint `file`: each one's chunks, and each described
    as a dataset (no digest of its own: its chunks have one each); None when it has none. Read
    without torch."""
    from hpcdist.store.sharded.layout import read_index, tensors_of

    _, text = read_index(file)
    tensors = tensors_of(text, MODEL_GROUP + ".")
    for key, entry in tensors.items():
        stale = [p for p in entry.pieces if p.chunk.shape != p.sizes]
        if stale:  # bf16 as bytes, from before the store's one encoding: never released
            raise CheckpointError(f"{file}: tensor {key} is stored as {stale[0].chunk.shape} for a chunk of "
                                  f"{stale[0].sizes}: written by an older hpcdist; save it again with this one")
    if not tensors:
        return {}, None
    infos = {k: DatasetInfo(e.size, np.dtype(e.pieces[0].chunk.dtype if e.pieces else "u1"), "", e.dtype)
             for k, e in tensors.items()}
    return {k: e.pieces for k, e in tensors.items()}, infos


def read_full(header: CheckpointHeader, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in its stored dtype, each checked against its digest when `verify`
    (a sharded checkpoint's chunks always are)."""
    if header.sharded:
        whole = _sharded_model(header.path)
        return {key: whole[key] for key in header.shapes}
    try:
        group = store.read(header.path, groups=(MODEL_GROUP,), verify=verify).tree[MODEL_GROUP]
    except ChecksumError as exc:
        key = exc.dataset.removeprefix(f"/{MODEL_GROUP}/")
        raise CheckpointError(
            f"checkpoint {header.path}: tensor {key} does not match its checksum; the file is corrupt"
        ) from exc
    return {key: as_tensor(group[key]) for key in header.shapes}

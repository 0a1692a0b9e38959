"""Reading the training job's HDF5 checkpoints for inference (format: ``hpcdist.checkpoint``).

The format (``hpcdist.checkpoint`` version 1), shared with the training job:

- files ``<dir>/step_<step:08d>.h5``, committed by the pointer file ``<dir>/latest`` holding
  the file name (written atomically);
- root attributes ``format``, ``format_version``, ``step``, ``epoch``, ``model_config_json``
  (``GPTConfig.model_dump_json()``), ``created``;
- group ``/model``: one float32, C-order dataset per ``state_dict()`` key of ``GPT`` (the tied
  ``lm_head.weight`` is not stored), each with attribute ``sha256`` = hex digest of its bytes.

Only h5py and numpy are imported here, so the login node checks a checkpoint against a spec
(names, shapes, model config) without reading any weights or importing torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdist.checkpoint import FORMAT, FORMAT_VERSION, POINTER, sha256_of
from hpcdist.errors import CheckpointError
from hpcdist.model.config import GPTConfig

TIED = ("lm_head.weight",)


def expected_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The stored tensors of a GPT of shape `cfg`, in ``state_dict()`` order, without torch."""
    d, h, v = cfg.d_model, cfg.d_hidden, cfg.vocab_size
    fc = h * (2 if cfg.mlp == "swiglu" else 1)
    out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (cfg.context, d)}
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        out.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "attn.c_attn.weight": (3 * d, d),
                p + "attn.c_attn.bias": (3 * d,),
                p + "attn.c_proj.weight": (d, d),
                p + "attn.c_proj.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "mlp.c_fc.weight": (fc, d),
                p + "mlp.c_fc.bias": (fc,),
                p + "mlp.c_proj.weight": (d, h),
                p + "mlp.c_proj.bias": (d,),
            }
        )
    out["transformer.ln_f.weight"] = (d,)
    out["transformer.ln_f.bias"] = (d,)
    return out


def resolve(path: str | Path) -> Path:
    """The checkpoint file for `path`: the file itself, or the one a directory's ``latest`` names."""
    path = Path(path)
    if path.is_dir():
        pointer = path / POINTER
        if not pointer.is_file():
            raise CheckpointError(
                f"checkpoint directory {path} has no committed checkpoint ({POINTER} is missing); "
                f"run the training job first or name a step_*.h5 file"
            )
        name = pointer.read_text().strip()
        target = path / name
        if not name or "/" in name or not target.is_file():
            raise CheckpointError(f"{pointer} names {name!r}, which is not a file in {path}; the checkpoint is damaged")
        return target
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; give a step_*.h5 file or a checkpoint directory")
    return path


@dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint holds, read without touching the weights."""

    path: Path
    step: int
    epoch: int
    config: GPTConfig
    shapes: dict[str, tuple[int, ...]]
    sha256: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * 4 for s in self.shapes.values())


def read_header(path: str | Path, expect: GPTConfig | None = None) -> CheckpointHeader:
    """The header of the checkpoint at `path`, checked for format, names, shapes and `expect`."""
    import h5py

    file = resolve(path)
    try:
        with h5py.File(file, "r") as f:
            attrs = {k: f.attrs[k] for k in f.attrs}
            if attrs.get("format") != FORMAT:
                raise CheckpointError(f"{file} is not an hpcdist checkpoint (format {attrs.get('format')!r})")
            if int(attrs.get("format_version", -1)) != FORMAT_VERSION:
                raise CheckpointError(
                    f"{file}: checkpoint format_version {attrs.get('format_version')!r} is not supported "
                    f"(this hpcdist reads {FORMAT_VERSION})"
                )
            try:
                cfg = GPTConfig.model_validate_json(str(attrs["model_config_json"]))
            except Exception as exc:  # noqa: BLE001 - any parse failure is a damaged header
                raise CheckpointError(f"{file}: model_config_json is missing or invalid ({exc})") from exc
            if "model" not in f:
                raise CheckpointError(f"{file} has no /model group; the checkpoint is damaged")
            group = f["model"]
            shapes = {k: tuple(int(n) for n in group[k].shape) for k in group}
            sums = {k: str(group[k].attrs.get("sha256", "")) for k in group}
            dtypes = {k: group[k].dtype for k in group}
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {file}: {exc}") from exc
    if expect is not None and expect != cfg:
        diff = {
            k: (getattr(expect, k), getattr(cfg, k))
            for k in GPTConfig.model_fields
            if getattr(expect, k) != getattr(cfg, k)
        }
        shown = ", ".join(f"{k}: spec {a!r} vs checkpoint {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(
            f"checkpoint {file} does not match the model in the spec ({shown}); "
            f"fix params.model or drop it to take the checkpoint's"
        )
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in shapes]
    extra = [k for k in shapes if k not in want]
    wrong = [f"{k} {shapes[k]} (expected {want[k]})" for k in want if k in shapes and shapes[k] != want[k]]
    bad_dtype = [k for k, t in dtypes.items() if t != np.float32]
    no_sum = [k for k, s in sums.items() if len(s) != 64]
    for what, items in (
        ("is missing tensors", missing),
        ("has tensors the model does not", extra),
        ("has tensors of the wrong shape", wrong),
        ("has tensors that are not float32", bad_dtype),
        ("has tensors without a sha256", no_sum),
    ):
        if items:
            more = f" and {len(items) - 3} more" if len(items) > 3 else ""
            raise CheckpointError(
                f"checkpoint {file} {what} for its model_config_json: {', '.join(items[:3])}{more}; "
                f"it was not written by this model"
            )
    return CheckpointHeader(
        path=file,
        step=int(attrs.get("step", -1)),
        epoch=int(attrs.get("epoch", -1)),
        config=cfg,
        shapes={k: shapes[k] for k in want},
        sha256={k: sums[k] for k in want},
    )


def read_full(header: CheckpointHeader, verify: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, each checked against its sha256 when `verify`."""
    import h5py

    out: dict[str, np.ndarray] = {}
    with h5py.File(header.path, "r") as f:
        for key in header.shapes:
            arr = np.ascontiguousarray(f["model"][key][()])
            if verify and sha256_of(arr) != header.sha256[key]:
                raise CheckpointError(
                    f"checkpoint {header.path}: tensor {key} does not match its sha256; the file is corrupt"
                )
            out[key] = arr
    return out


def verify_streaming(header: CheckpointHeader, key: str, chunk_bytes: int = 16 << 20) -> bool:
    """Whether tensor `key` matches its sha256, reading it in row chunks (bounded memory)."""
    import h5py

    digest = hashlib.sha256()
    with h5py.File(header.path, "r") as f:
        ds = f["model"][key]
        if ds.ndim == 0 or ds.shape[0] == 0:
            digest.update(np.ascontiguousarray(ds[()]).tobytes())
        else:
            row_bytes = max(1, ds.size // ds.shape[0]) * ds.dtype.itemsize
            step = max(1, chunk_bytes // row_bytes)
            for start in range(0, ds.shape[0], step):
                digest.update(np.ascontiguousarray(ds[start : start + step]).tobytes())
    return digest.hexdigest() == header.sha256[key]


def write_checkpoint(
    directory: str | Path, step: int, state: Mapping[str, Any], cfg: GPTConfig, epoch: int = 0
) -> Path:
    """Write `state` (a GPT ``state_dict()``) as a model-only checkpoint and commit it (tests, demos)."""
    from hpcdist.checkpoint import model_tree, save

    stats = save(Path(directory), step=step, epoch=epoch, model_config_json=cfg.model_dump_json(),
                 tree={"model": model_tree(state)})
    return stats.path

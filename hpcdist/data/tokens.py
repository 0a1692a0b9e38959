"""The token file: local text tokenised into train and validation splits, in HDF5.

Layout (format ``hpcdist.tokens`` version 1):

- root attributes: ``format``, ``format_version``, ``tokenizer`` (``bytes`` or
  ``tokenizers:<file name>``), ``tokenizer_sha256`` (of its canonical JSON, empty for bytes),
  ``vocab_size``, ``eot_id``, ``val_fraction``, ``sources`` and ``sources_sha256`` (one per text
  file), ``created``;
- ``/train`` and ``/val``: 1-D token ids (uint16 when the vocabulary fits, else uint32), each
  document followed by the end-of-text token, with a ``sha256`` attribute;
- ``/tokenizer``: the tokenizer itself (``hpcdist.data.tokenizer``), which training records in
  every checkpoint so inference decodes with it.

Each document is split on its own (its first ``1 - val_fraction`` to train, the rest to
validation) so the validation split samples every source. Written atomically.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.errors import JobError
from hpcdist.files.atomic import atomic_path

if TYPE_CHECKING:
    from hpcdist.data.tokenizer import Tokenizer

FORMAT = "hpcdist.tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


@dataclass(frozen=True)
class TokenFileInfo:
    path: Path
    vocab_size: int
    eot_id: int
    tokenizer: str
    lengths: dict[str, int]

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer the file was written with (bytes for a file from before tokenizers travelled)."""
        from hpcdist.data.tokenizer import BYTES, read_tokenizer

        if self.tokenizer == BYTES.name:
            return BYTES
        try:
            return read_tokenizer(self.path)
        except JobError as exc:
            raise JobError(f"{exc}; prepare the token file again with this hpcdist") from exc


def prepare(
    texts: Sequence[Path], out: Path, *, val_fraction: float = 0.1, tokenizer: Path | None = None
) -> TokenFileInfo:
    """Tokenise `texts` into `out`; returns what was written."""
    import h5py

    from hpcdist.data.tokenizer import GROUP, load_tokenizer
    from hpcdist.store.checkpoint.rawio import write_tree
    from hpcdist.store.checkpoint.tree import sha256_of

    if not texts:
        raise JobError("data prepare: give at least one text file")
    if not 0 <= val_fraction < 1:
        raise JobError(f"data prepare: --val-fraction {val_fraction} must be in [0, 1)")
    tok = load_tokenizer(tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    hashes = []
    eot = np.array([tok.eot_id], dtype=dtype)
    for path in texts:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise JobError(f"data prepare: cannot read {path}: {exc.strerror}") from exc
        hashes.append(hashlib.sha256(raw).hexdigest())
        ids = tok.encode(raw).astype(dtype)
        cut = int(round(len(ids) * (1 - val_fraction)))
        parts["train"] += [ids[:cut], eot]
        if cut < len(ids):
            parts["val"] += [ids[cut:], eot]
    arrays = {s: np.concatenate(parts[s]) if parts[s] else np.zeros(0, dtype) for s in SPLITS}
    tok_hash = tok.identity.removeprefix("sha256:") if tok.identity.startswith("sha256:") else ""
    with atomic_path(Path(out)) as tmp:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["tokenizer"] = tok.name
            f.attrs["tokenizer_sha256"] = tok_hash
            f.attrs["vocab_size"] = tok.vocab_size
            f.attrs["eot_id"] = tok.eot_id
            f.attrs["val_fraction"] = val_fraction
            f.attrs["sources"] = np.array([str(Path(p).resolve()) for p in texts], dtype=h5py.string_dtype())
            f.attrs["sources_sha256"] = np.array(hashes, dtype=h5py.string_dtype())
            f.attrs["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            for split, arr in arrays.items():
                dset = f.create_dataset(split, data=arr)
                dset.attrs["sha256"] = sha256_of(arr)
            write_tree(f, {GROUP: tok.to_tree()})
    return TokenFileInfo(Path(out), tok.vocab_size, tok.eot_id, tok.name, {s: len(a) for s, a in arrays.items()})


def describe(path: Path) -> TokenFileInfo:
    """What a token file holds; a JobError naming the file if it is not one."""
    import h5py

    path = Path(path)
    if not path.is_file():
        raise JobError(f"token file {path} does not exist; make it with `hpcdist data prepare TEXT... -o {path}`")
    try:
        with h5py.File(path, "r") as f:
            attrs: dict[str, Any] = dict(f.attrs)
            lengths = {s: int(f[s].shape[0]) for s in SPLITS if s in f}
    except OSError as exc:
        raise JobError(f"token file {path} cannot be read as HDF5 ({exc}); prepare it again") from exc
    fmt = attrs.get("format")
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    if fmt != FORMAT or set(lengths) != set(SPLITS):
        raise JobError(f"{path} is not an hpcdist token file (format {fmt!r}); make it with `hpcdist data prepare`")
    name = attrs["tokenizer"]
    return TokenFileInfo(
        path,
        int(attrs["vocab_size"]),
        int(attrs["eot_id"]),
        name.decode() if isinstance(name, bytes) else str(name),
        lengths,
    )

"""The one owner of tokenizers: bytes (the default) or a Hugging Face ``tokenizers`` tokenizer.

The byte-level tokenizer maps each UTF-8 byte to its value and uses 256 as the end-of-text
token that separates documents, so its vocabulary is 257 and every text round-trips exactly.
A `FileTokenizer` wraps a ``tokenizers`` tokenizer (a ``tokenizer.json``, a ``save_pretrained``
folder, or one carried inside a token file or checkpoint) and is identified by the SHA-256 of
its canonical JSON, so two copies of the same tokenizer compare equal wherever they came from.

A tokenizer travels as a small tree (`to_tree` / `from_tree`): the attributes ``name``,
``identity``, ``vocab_size``, ``eot_id``, ``eot_token`` and, for a ``tokenizers`` one, its JSON
as the uint8 dataset ``json_utf8`` (with its sha256, like every stored array). Token files
(``hpcdist.data.tokens``) and checkpoints (``hpcdist.model.checkpoint``) store that tree, so
training records the tokenizer of its data and inference decodes with the model's own.

NumPy is imported only where arrays are made, so the login node validates an inference spec
(which encodes its prompts) without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpcdist.errors import JobError

if TYPE_CHECKING:
    import numpy as np

END_OF_TEXT = 256  # the byte tokenizer's end-of-text id
EOT_TOKEN = "<|endoftext|>"  # GPT-2's end-of-text token, the default of a `tokenizers` file
GROUP = "tokenizer"  # where token files and checkpoints keep the tree
SENTENCEPIECE = "tokenizer.model"  # a SentencePiece model, as Llama 2 and Mistral folders have
# what a SentencePiece conversion must encode as SentencePiece does: words, digits, punctuation,
# repeated spaces, newlines, accents and characters outside the vocabulary (byte fallback)
SPM_PROBE = "The cluster ran 12 jobs overnight.  Two spaces,\nthen a new line: naïve café, 3.14 ✓ 東京"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int
    eot_token: str

    @property
    def identity(self) -> str: ...

    def encode(self, text: bytes) -> np.ndarray: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int] | np.ndarray) -> str: ...

    def to_tree(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """Bytes as tokens, 256 as end-of-text."""

    name = "bytes"
    vocab_size = END_OF_TEXT + 1
    eot_id = END_OF_TEXT
    eot_token = ""
    identity = "bytes"

    def encode(self, text: bytes) -> np.ndarray:
        """A document's token ids as an array (``data prepare``)."""
        import numpy as np

        return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)

    def encode_text(self, text: str) -> list[int]:
        """A prompt's token ids: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text for token ids; ids outside the byte range (the end token) are dropped, bad UTF-8 replaced."""
        data = bytes(i for i in map(int, ids) if 0 <= i < END_OF_TEXT)
        return data.decode("utf-8", errors="replace")

    def to_tree(self) -> dict[str, Any]:
        return _header(self)


BYTES = ByteTokenizer()


def _header(tok: Tokenizer) -> dict[str, Any]:
    return {"name": tok.name, "identity": tok.identity, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
            "eot_token": tok.eot_token}


def _hf() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise JobError("a `tokenizers` tokenizer needs the package: pip install 'hpcdist[tokenizers]'") from exc
    return tokenizers


class FileTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, held as its JSON; no file is needed once loaded.

    The end-of-text id is `eot_token`'s; a tokenizer without that token gets one more id past
    its vocabulary, used only to separate documents.
    """

    def __init__(self, json_text: str, name: str, eot_token: str = EOT_TOKEN) -> None:
        try:
            self._tok = _hf().Tokenizer.from_str(json_text)
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise JobError(f"tokenizer {name} cannot be read by `tokenizers`: {exc}") from exc
        self.json = self._tok.to_str()  # canonical: the same tokenizer gives the same text
        self.name = name
        self.eot_token = eot_token
        eot = self._tok.token_to_id(eot_token)
        base = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = base if eot is None else int(eot)
        self.vocab_size = base + (1 if eot is None else 0)

    @classmethod
    def from_file(cls, path: Path, eot_token: str = EOT_TOKEN) -> FileTokenizer:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise JobError(f"tokenizer file {path} cannot be read: {exc}") from exc
        return cls(text, f"tokenizers:{Path(path).name}", eot_token)

    @property
    def identity(self) -> str:
        return "sha256:" + hashlib.sha256(self.json.encode("utf-8")).hexdigest()

    def encode(self, text: bytes) -> np.ndarray:
        import numpy as np

        return np.asarray(self.encode_text(text.decode("utf-8", errors="replace")), dtype=np.uint32)

    def encode_text(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return str(self._tok.decode([int(i) for i in ids if int(i) != self.eot_id]))

    def to_tree(self) -> dict[str, Any]:
        import numpy as np

        return {**_header(self), "json_utf8": np.frombuffer(self.json.encode("utf-8"), dtype=np.uint8)}


def from_tree(tree: Mapping[str, Any], where: str) -> ByteTokenizer | FileTokenizer:
    """The tokenizer a `to_tree` tree describes (as the store reads it back); `where` names its file."""
    if tree.get("identity") == BYTES.identity:
        return BYTES
    if "json_utf8" not in tree:
        raise JobError(f"{where}: the tokenizer {tree.get('name')!r} is recorded without its JSON; write it again")
    text = bytes(memoryview(tree["json_utf8"])).decode("utf-8")
    return FileTokenizer(text, str(tree.get("name", "tokenizers")), str(tree.get("eot_token") or EOT_TOKEN))


def from_pretrained_dir(directory: Path) -> FileTokenizer:
    """The tokenizer of a ``save_pretrained`` folder (tokenizer.json, or vocab.json with merges.txt,
    or only a SentencePiece tokenizer.model: `from_sentencepiece`), read by ``transformers`` so its
    special tokens come with it. Nothing is downloaded."""
    directory = Path(directory)
    if not any((directory / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        if (directory / SENTENCEPIECE).is_file():
            return from_sentencepiece(directory)
        raise JobError(
            f"{directory} has no tokenizer: expected tokenizer.json, or vocab.json with merges.txt "
            f"(save the tokenizer with save_pretrained into the same folder)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise JobError("reading a save_pretrained tokenizer needs transformers: pip install 'hpcdist[hf]'") from exc
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        text = hf.backend_tokenizer.to_str()
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad folder
        raise JobError(f"the tokenizer in {directory} cannot be read by transformers: {exc}") from exc
    return FileTokenizer(text, f"tokenizers:{directory.name}", str(hf.eos_token or EOT_TOKEN))


def from_sentencepiece(directory: Path) -> FileTokenizer:
    """The ``tokenizers`` form of a folder whose only tokenizer is a SentencePiece ``tokenizer.model``
    (Llama 2's and Mistral's), converted by transformers' ``LlamaTokenizer`` with the folder's
    tokenizer_config.json, as ``AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`` would; it
    needs the ``sentencepiece`` extra. The conversion is checked: `SPM_PROBE` must encode to the ids
    SentencePiece itself gives, else it is refused rather than approximated."""
    model = directory / SENTENCEPIECE
    try:
        import google.protobuf  # noqa: F401 - transformers' converter reads the model through protobuf
        import sentencepiece
    except ImportError as exc:
        raise JobError(
            f"{directory} has only a SentencePiece {SENTENCEPIECE}; install the sentencepiece extra to convert "
            f"it on import (pip install 'hpcdist[sentencepiece]'), or convert it once with transformers and "
            f"sentencepiece (AutoTokenizer.from_pretrained(dir).save_pretrained(dir) writes tokenizer.json)"
        ) from exc
    try:
        from transformers import LlamaTokenizer
    except ImportError as exc:
        raise JobError("converting a SentencePiece tokenizer needs transformers: pip install 'hpcdist[hf]'") from exc
    try:
        theirs = sentencepiece.SentencePieceProcessor(model_file=str(model)).encode(SPM_PROBE)
        hf = LlamaTokenizer.from_pretrained(str(directory), local_files_only=True)
        ours = hf(SPM_PROBE, add_special_tokens=False)["input_ids"]
        text = hf.backend_tokenizer.to_str()
    except Exception as exc:  # noqa: BLE001 - sentencepiece and transformers raise many kinds for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise JobError(f"{model} cannot be converted as a SentencePiece model: {first}") from exc
    if ours != theirs:
        raise JobError(
            f"{model}: its tokenizers form encodes text differently from SentencePiece (ids {ours[:8]} vs "
            f"{theirs[:8]}); hpcdist refuses rather than approximates it: give the model's tokenizer.json"
        )
    return FileTokenizer(text, f"tokenizers:{directory.name}", str(hf.eos_token or EOT_TOKEN))


def load_tokenizer(path: Path | None) -> ByteTokenizer | FileTokenizer:
    """Bytes for None; else a tokenizer.json, a ``save_pretrained`` folder, or the tokenizer an
    hpcdist checkpoint or token file (``.h5``) carries."""
    if path is None:
        return BYTES
    path = Path(path)
    if path.is_dir():
        return from_pretrained_dir(path)
    if path.suffix == ".h5":
        return read_tokenizer(path)
    return FileTokenizer.from_file(path)


def read_tokenizer(path: Path) -> ByteTokenizer | FileTokenizer:
    """The tokenizer stored in an HDF5 file's ``/tokenizer`` group (a token file or a checkpoint)."""
    import h5py

    from hpcdist.store.checkpoint.tree import read_tree

    try:
        with h5py.File(path, "r") as f:
            if GROUP not in f:
                raise JobError(f"{path} carries no tokenizer; give a tokenizer.json or a save_pretrained folder")
            tree, _ = read_tree({GROUP: f[GROUP]}, verify=True, where=path)
    except OSError as exc:
        raise JobError(f"{path} cannot be read as HDF5 ({exc})") from exc
    return from_tree(tree[GROUP], str(path))


def mismatch(
    data: Tokenizer, data_path: object, other: Mapping[str, Any] | Tokenizer, other_path: object
) -> str | None:
    """Why token file `data_path` cannot train the model of checkpoint `other_path` (its
    tokenizer, or the tree recorded in it): a different tokenizer. None when they are the same."""
    name = other["name"] if isinstance(other, Mapping) else other.name
    identity = other["identity"] if isinstance(other, Mapping) else other.identity
    if identity == data.identity:
        return None
    return (
        f"token file {data_path} was prepared with tokenizer {data.name} ({data.identity[:19]}) but checkpoint "
        f"{other_path} holds a model of tokenizer {name} ({str(identity)[:19]}); prepare the text again with "
        f"`hpcdist data prepare TEXT... --tokenizer {other_path} -o TOKENS.h5`"
    )

"""Tokenizers that need nothing downloaded: bytes (the default) or a local ``tokenizers`` file.

The byte-level tokenizer maps each UTF-8 byte to its value and uses 256 as the end-of-text
token that separates documents, so its vocabulary is 257 and every text round-trips exactly.
It is the one byte tokenizer: ``data prepare`` writes token files with it and inference
encodes prompts and decodes outputs with it (``encode_text``/``decode``).

NumPy is imported only by the array methods, so the login node validates an inference spec
(which encodes its prompts) without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hpcdist.errors import JobError

if TYPE_CHECKING:
    import numpy as np

END_OF_TEXT = 256  # the byte tokenizer's end-of-text id


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: bytes) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


class ByteTokenizer:
    """Bytes as tokens, 256 as end-of-text."""

    name = "bytes"
    vocab_size = END_OF_TEXT + 1
    eot_id = END_OF_TEXT

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


BYTES = ByteTokenizer()


class FileTokenizer:
    """A tokenizer saved by Hugging Face's ``tokenizers`` library (``tokenizer.json``), read locally."""

    def __init__(self, path: Path, eot_token: str = "<|endoftext|>") -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as exc:
            raise JobError(
                "--tokenizer needs the `tokenizers` package: pip install 'hpcdist[tokenizers]'"
            ) from exc
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise JobError(f"tokenizer file {path} cannot be read by `tokenizers`: {exc}") from exc
        self.name = f"tokenizers:{Path(path).name}"
        eot = self._tok.token_to_id(eot_token)
        base = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = base if eot is None else int(eot)
        self.vocab_size = base + (1 if eot is None else 0)

    def encode(self, text: bytes) -> np.ndarray:
        import numpy as np

        ids = self._tok.encode(text.decode("utf-8", errors="replace")).ids
        return np.asarray(ids, dtype=np.uint32)

    def decode(self, ids: np.ndarray) -> str:
        return str(self._tok.decode([int(i) for i in ids if int(i) != self.eot_id]))


def load_tokenizer(path: Path | None) -> ByteTokenizer | FileTokenizer:
    return BYTES if path is None else FileTokenizer(path)

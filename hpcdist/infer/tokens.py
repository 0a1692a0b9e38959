"""Text <-> token ids for inference: byte-level, ids 0-255 are the UTF-8 bytes, 256 ends a text.

Kept in one place so the inference job can be pointed at the project's shared tokenizer
(``hpcdist.data``) by changing these three names only.
"""

from __future__ import annotations

END_TOKEN = 256
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    """Token ids for `text`: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Text for token ids; ids outside the byte range (the end token) are dropped, bad UTF-8 is replaced."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

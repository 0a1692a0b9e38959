"""A dataset's digest computed here, independently of ``hpcdist.store.checksum``, to compare with
what a checkpoint records (format 2: the attribute ``checksum``, ``"<algorithm>:<hex>"``)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import xxhash


def digest_of(data: Any, algorithm: str = "xxh3-128") -> str:
    raw = np.ascontiguousarray(data).tobytes()
    hexdigest = xxhash.xxh3_128_hexdigest(raw) if algorithm == "xxh3-128" else hashlib.sha256(raw).hexdigest()
    return f"{algorithm}:{hexdigest}"

"""The checksum of every array a checkpoint holds: which algorithm, the digest, the check.

A checkpoint guards against torn writes, flipped bits and truncated files, not against a forger
(whoever writes the index writes the digests), so the default is a non-cryptographic hash that
runs at memory speed: XXH3-128 (``xxhash``), 17.9 GB/s on one core of this machine against
sha256's 1.7 (CRC32C 6.8, BLAKE3 6.0 on one thread; ``docs/your-code.md``).
sha256 stays a choice (``storage.checksum`` of the site, ``checkpoint.checksum`` of a training
job, ``hpcdist.init(checksum=...)``, or ``HPCDIST_CHECKSUM``) for those who want a
cryptographic digest.

A recorded digest names its algorithm: ``"xxh3-128:<32 hex>"`` or ``"sha256:<64 hex>"``
(checkpoint format 2). A bare 64-hex digest is a sha256 from a format-1 file, which still loads.
The one place digests are made and compared; the store, the model layer and inference call it.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from hpcdist.errors import CheckpointError

XXH3 = "xxh3-128"
SHA256 = "sha256"
ALGORITHMS = (XXH3, SHA256)
DEFAULT = XXH3
ENV = "HPCDIST_CHECKSUM"  # the process's choice, when no site or job names one
ATTR = "checksum"  # format 2: a dataset's digest, and the file's algorithm as a root attribute
LEGACY_ATTR = "sha256"  # format 1: a dataset's bare hex sha256

_chosen: str | None = None  # the job's choice (`use`)
_site: str | None = None  # the site's (`use_site`)


def check_name(name: str, where: str = "checksum") -> str:
    """`name` if it is an algorithm this hpcdist writes, else a one-line error."""
    if name not in ALGORITHMS:
        raise CheckpointError(f"{where} {name!r} is not a checksum this hpcdist knows; use one of "
                              f"{', '.join(ALGORITHMS)}")
    return name


def use(name: str | None) -> None:
    """Make `name` the algorithm this process writes from now on (None: back to the default)."""
    global _chosen
    _chosen = None if name is None else check_name(name)


def use_site(name: str) -> None:
    """The site's choice (``storage.checksum``): used unless the job's environment names one
    (``HPCDIST_CHECKSUM``) or the job chose with `use`."""
    global _site
    _site = check_name(name)


def chosen() -> str:
    """The algorithm a checkpoint written now records: the job's (`use`), else ``HPCDIST_CHECKSUM``,
    else the site's (`use_site`), else XXH3-128."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get(ENV, "").strip()
    return check_name(env, ENV) if env else _site or DEFAULT


def _bytes(data: Any) -> Any:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    arr = np.ascontiguousarray(data)
    return arr.reshape(-1).view(np.uint8).data if arr.size else b""


def digest(data: Any, algorithm: str | None = None) -> str:
    """``"<algorithm>:<hex>"`` of an array's C-order bytes (or of bytes), hashed in place; the GIL is
    released while hashing, so threads overlap it with I/O."""
    algorithm = algorithm or chosen()
    raw = _bytes(data)
    if algorithm == XXH3:
        import xxhash

        return f"{XXH3}:{xxhash.xxh3_128_hexdigest(raw)}"
    if algorithm == SHA256:
        return f"{SHA256}:{hashlib.sha256(raw).hexdigest()}"
    raise CheckpointError(f"checksum {algorithm!r} is not one this hpcdist knows ({', '.join(ALGORITHMS)})")


def algorithm_of(recorded: str) -> str:
    """The algorithm a recorded digest was made with ("" when there is none); a bare 64-hex
    digest is format 1's sha256. An unknown name is a one-line error saying to upgrade."""
    if not recorded:
        return ""
    name, sep, _ = recorded.partition(":")
    if not sep:
        return SHA256 if len(recorded) == 64 else ""
    if name not in ALGORITHMS:
        raise CheckpointError(f"checksum {name!r} is not one this hpcdist knows ({', '.join(ALGORITHMS)}); "
                              "upgrade hpcdist to read this file")
    return name


def digest_like(data: Any, recorded: str) -> str:
    """`data`'s digest made with `recorded`'s algorithm, spelled as `recorded` is (bare for format 1)."""
    algorithm = algorithm_of(recorded) or chosen()
    made = digest(data, algorithm)
    return made.partition(":")[2] if ":" not in recorded and recorded else made


def matches(data: Any, recorded: str) -> bool:
    """Whether `data` has the recorded digest (False when none is recorded)."""
    return bool(recorded) and digest_like(data, recorded) == recorded


def is_digest(recorded: str) -> bool:
    """Whether `recorded` is a digest this hpcdist can check (either format)."""
    try:
        name = algorithm_of(recorded)
    except CheckpointError:
        return False
    hexpart = recorded.partition(":")[2] if ":" in recorded else recorded
    return bool(name) and len(hexpart) == {XXH3: 32, SHA256: 64}[name]


def recorded_in(attrs: Any) -> str:
    """A dataset's recorded digest from its attributes: format 2's ``checksum``, else format 1's ``sha256``."""
    for key in (ATTR, LEGACY_ATTR):
        value = attrs.get(key, "")
        if value:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""

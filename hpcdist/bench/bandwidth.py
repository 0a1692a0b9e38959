"""The one table of bandwidth arithmetic: message sizes, element counts, algbw and busbw.

The figures follow nccl-tests (``doc/PERFORMANCE.md``) exactly, so a number from hpcdist means
what the same number from nccl-tests means:

- ``algbw = size_bytes / 1e9 / seconds`` (GB/s, decimal);
- ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for
  all_gather, reduce_scatter and all_to_all (``size`` being the total gathered, scattered or
  exchanged size), and 1 for broadcast, reduce and point to point;
- for all_gather, reduce_scatter and all_to_all the element count is rounded down to a multiple
  of the number of ranks, and ``size_bytes`` is the rounded figure.

Pure functions only (no torch, no MPI): the login node validates specs with this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "barrier",
)
P2P_TESTS: tuple[str, ...] = ("pingpong", "unidir", "bidir")

# Bytes per element of the data types a benchmark may use.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float64": 8, "int32": 4, "float16": 2, "bfloat16": 2}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def bus_factor(op: str, nranks: int) -> float:
    """busbw / algbw for `op` on `nranks` ranks (nccl-tests' table)."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    n = float(nranks)
    if op == "all_reduce":
        return 2.0 * (n - 1.0) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1.0) / n
    if op in ("broadcast", "reduce", "barrier") or op in P2P_TESTS or op == "pair":
        return 1.0
    raise ValueError(f"no bus bandwidth factor for operation {op!r}; known: {', '.join(COLLECTIVES + P2P_TESTS)}")


def algbw(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes), as nccl-tests prints it."""
    if seconds <= 0:
        return float("nan")
    return size_bytes / 1e9 / seconds


def busbw(op: str, size_bytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: algbw scaled by the operation's factor."""
    return algbw(size_bytes, seconds) * bus_factor(op, nranks)


@dataclass(frozen=True)
class Counts:
    """Element counts of one collective call, as nccl-tests derives them from a size."""

    size_bytes: int  # the size the bandwidth is computed from (after rounding)
    count: int  # elements of the op's "count" (total gathered/scattered, or per-rank buffer)
    send: int  # elements each rank sends
    recv: int  # elements each rank receives


def counts(op: str, size_bytes: int, nranks: int, itemsize: int) -> Counts:
    """How many elements `op` moves for a requested `size_bytes` (rounded down like nccl-tests)."""
    elems = max(size_bytes // itemsize, 0)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        per_rank = elems // nranks
        total = per_rank * nranks
        if op == "all_gather":
            return Counts(total * itemsize, total, per_rank, total)
        if op == "reduce_scatter":
            return Counts(total * itemsize, total, total, per_rank)
        return Counts(total * itemsize, total, total, total)
    if op == "barrier":
        return Counts(0, 0, 0, 0)
    return Counts(elems * itemsize, elems, elems, elems)


def parse_size(value: int | str) -> int:
    """Bytes from ``4096``, ``"64K"``, ``"4M"``, ``"1G"``, ``"8MiB"`` (K/M/G are powers of 1024, as in nccl-tests)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size; write bytes (4096) or with K, M, G (64K, 4M, 1G)")
    number, unit = float(match.group(1)), match.group(2).upper()
    result = number * _UNITS[unit]
    if not result.is_integer():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(result)


def sweep(min_bytes: int, max_bytes: int, factor: int | None = 2, step_bytes: int | None = None) -> list[int]:
    """The sizes of a sweep, as nccl-tests' ``-b MIN -e MAX -f FACTOR`` or ``-i STEP``."""
    if min_bytes <= 0 or max_bytes <= 0:
        raise ValueError(f"sizes must be positive, got min {min_bytes} and max {max_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"max size {max_bytes} is below min size {min_bytes}")
    sizes: list[int] = []
    size = min_bytes
    if step_bytes is not None:
        if step_bytes <= 0:
            raise ValueError(f"step must be positive, got {step_bytes}")
        while size <= max_bytes:
            sizes.append(size)
            size += step_bytes
        return sizes
    if factor is None or factor < 2:
        raise ValueError(f"factor must be an integer >= 2, got {factor}")
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def human_bytes(n: int) -> str:
    """``4194304`` -> ``4M``: the short form used in tables and plots."""
    for unit in ("G", "M", "K"):
        scale = _UNITS[unit]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)

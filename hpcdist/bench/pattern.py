"""The data check: what every rank puts in its buffers, what each collective must return, and
how many elements came back wrong (the ``#wrong`` column of nccl-tests).

Element ``i`` of rank ``r``'s input is ``(i + 3 r) mod 8``: small integers, so sums are exact in
every data type up to dozens of ranks, and no two neighbouring ranks hold the same data (a
mix-up of ranks or offsets is counted). The arrays are NumPy or torch: an ``Arrays`` adapter
makes the arithmetic the same for both, on the device where the buffer lives.
"""

from __future__ import annotations

from typing import Any

from hpcdist.bench.bandwidth import Counts

CYCLE = 8
STRIDE = 3  # odd, so r -> (i + 3r) mod 8 visits every residue once every 8 ranks
CYCLE_SUM = CYCLE * (CYCLE - 1) // 2


class Arrays:
    """The few array operations the check needs, for NumPy (``device=None``) or torch."""

    def __init__(self, lib: str = "numpy", device: Any = None) -> None:
        self.lib = lib
        self.device = device

    def arange(self, start: int, stop: int) -> Any:
        if self.lib == "torch":
            import torch

            return torch.arange(start, stop, dtype=torch.int64, device=self.device)
        import numpy as np

        return np.arange(start, stop, dtype=np.int64)

    def count_wrong(self, out: Any, expected: Any, exact: bool) -> int:
        """Elements of `out` that differ from `expected` (exactly, or by more than 1 % for half types).

        Both sides are compared as float64, which holds every value of the pattern exactly, so a
        fractional corruption is not rounded away.
        """
        if self.lib == "torch":
            got, want = out.reshape(-1).double(), expected.double()
        else:
            got, want = out.reshape(-1).astype("float64"), expected.astype("float64")
        if exact:
            bad = got != want
        else:
            bad = abs(got - want) > 0.01 * abs(want) + 1e-6
        return int(bad.sum())


def values(ax: Arrays, rank: int, start: int, count: int) -> Any:
    """Rank `rank`'s input elements ``start .. start+count`` (int64)."""
    return (ax.arange(start, start + count) + STRIDE * rank) % CYCLE


def reduced(ax: Arrays, nranks: int, start: int, count: int) -> Any:
    """The sum over all ranks of their elements ``start .. start+count``."""
    full, rest = divmod(nranks, CYCLE)
    total = ax.arange(0, count) * 0 + full * CYCLE_SUM
    for r in range(full * CYCLE, full * CYCLE + rest):
        total = total + values(ax, r, start, count)
    return total


def exact_for(dtype: str, nranks: int) -> bool:
    """Whether sums of the pattern are exact in `dtype` (half types lose integers above 256/2048)."""
    peak = (CYCLE - 1) * nranks
    if dtype == "bfloat16":
        return peak <= 256
    if dtype == "float16":
        return peak <= 2048
    return True


def send_values(ax: Arrays, op: str, rank: int, c: Counts) -> Any:
    """What rank `rank` sends for `op` (its whole input buffer)."""
    return values(ax, rank, 0, c.send)


def expected(ax: Arrays, op: str, rank: int, nranks: int, c: Counts, root: int = 0) -> Any | None:
    """What `rank` must hold after `op`, or None where the op leaves nothing defined (non-root reduce)."""
    if op == "all_reduce":
        return reduced(ax, nranks, 0, c.count)
    if op == "reduce":
        return reduced(ax, nranks, 0, c.count) if rank == root else None
    if op == "broadcast":
        return values(ax, root, 0, c.count)
    if op == "all_gather":
        m = c.send
        k = ax.arange(0, c.recv)
        return (k % m + STRIDE * (k // m)) % CYCLE
    if op == "reduce_scatter":
        return reduced(ax, nranks, rank * c.recv, c.recv)
    if op == "all_to_all":
        m = c.count // nranks
        k = ax.arange(0, c.recv)
        return (rank * m + k % m + STRIDE * (k // m)) % CYCLE
    if op == "barrier":
        return None
    raise ValueError(f"no data check for operation {op!r}")

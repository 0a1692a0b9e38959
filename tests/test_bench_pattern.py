"""The data check: correct collective results count zero wrong elements, a corrupted one counts exactly
the corrupted elements. Results are computed here by a plain reference implementation of each
collective from every rank's input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hpcdist.bench import pattern
from hpcdist.bench.bandwidth import Counts, counts
from hpcdist.bench.base import Prepared, host_timed
from tests.support.cli import require_module

N = 3
AX = pattern.Arrays("numpy")


def reference(op: str, size: int, nranks: int) -> list[np.ndarray | None]:
    """What each rank holds after `op`, computed from the inputs the ranks send."""
    c = counts(op, size, nranks, 4)
    inputs = [np.asarray(pattern.send_values(AX, op, r, c), dtype=np.float32) for r in range(nranks)]
    m = c.count // nranks
    total = np.sum(inputs, axis=0) if op in ("all_reduce", "reduce", "reduce_scatter") else None
    if op == "all_reduce":
        return [total for _ in range(nranks)]
    if op == "reduce":
        return [total] + [None] * (nranks - 1)
    if op == "broadcast":
        return [inputs[0] for _ in range(nranks)]
    if op == "all_gather":
        return [np.concatenate(inputs) for _ in range(nranks)]
    if op == "reduce_scatter":
        assert total is not None
        return [total[q * m : (q + 1) * m] for q in range(nranks)]
    if op == "all_to_all":
        return [np.concatenate([inputs[p][q * m : (q + 1) * m] for p in range(nranks)]) for q in range(nranks)]
    raise AssertionError(op)


@pytest.mark.parametrize("op", ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"])
def test_correct_results_have_no_wrong_elements(op: str) -> None:
    size = 4 * 3 * 50
    c = counts(op, size, N, 4)
    for rank, got in enumerate(reference(op, size, N)):
        want = pattern.expected(AX, op, rank, N, c)
        if got is None:
            assert want is None
            continue
        assert AX.count_wrong(got, want, exact=True) == 0


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "all_to_all"])
def test_a_corrupted_buffer_is_counted_as_wrong(op: str) -> None:
    size = 4 * 3 * 50
    c = counts(op, size, N, 4)
    got = reference(op, size, N)[1]
    assert got is not None
    bad = got.copy()
    bad[[0, 7]] += 1.0
    bad[len(bad) - 1] += 0.5  # a fractional error is not rounded away
    assert AX.count_wrong(bad, pattern.expected(AX, op, 1, N, c), exact=True) == 3


def test_ranks_swapped_are_caught() -> None:
    """Neighbouring ranks hold different data, so a gather in the wrong order is counted."""
    c = counts("all_gather", 4 * 2 * 40, 2, 4)
    good = np.concatenate([pattern.send_values(AX, "all_gather", r, c) for r in (0, 1)])
    swapped = np.concatenate([pattern.send_values(AX, "all_gather", r, c) for r in (1, 0)])
    want = pattern.expected(AX, "all_gather", 0, 2, c)
    assert AX.count_wrong(good, want, exact=True) == 0
    assert AX.count_wrong(swapped, want, exact=True) > 0


def test_sums_are_exact_over_many_ranks_and_checked_with_tolerance_in_half_types() -> None:
    c = counts("all_reduce", 4 * 64, 37, 4)
    inputs = [pattern.values(AX, r, 0, c.count) for r in range(37)]
    total = np.sum(inputs, axis=0).astype(np.float32)
    assert AX.count_wrong(total, pattern.expected(AX, "all_reduce", 0, 37, c), exact=True) == 0
    assert pattern.exact_for("bfloat16", 37) is False and pattern.exact_for("float32", 4096) is True


def test_torch_arrays_count_the_same() -> None:
    torch = require_module("torch")
    tx = pattern.Arrays("torch", torch.device("cpu"))
    c = counts("all_reduce", 4 * 100, 4, 4)
    want = pattern.expected(tx, "all_reduce", 0, 4, c)
    got = sum(pattern.values(tx, r, 0, c.count) for r in range(4)).to(torch.float32)
    assert tx.count_wrong(got, want, exact=True) == 0
    got[5] = -1
    assert tx.count_wrong(got, want, exact=True) == 1
    assert tx.count_wrong(got.to(torch.bfloat16), want, exact=False) == 1


class _RecordingPath:
    """A one-rank path whose all_reduce records its input at every call (no communication)."""

    name, label, rank, size = "mpi", "mpi/numpy", 0, 1

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []

    def arrays(self) -> pattern.Arrays:
        return AX

    def prepare(self, op: str, c: Counts, mode: str, dtype: str) -> Prepared:
        count = c.count
        buf = np.zeros(count, dtype=np.float32)  # fresh zeros, as the real paths allocate

        def fill() -> None:
            buf[:] = pattern.values(AX, self.rank, 0, count)

        return Prepared(step=lambda: self.seen.append(buf.copy()), fill=fill, output=lambda: buf)

    def timed(self, step: Callable[[], Any], iters: int) -> np.ndarray:
        return host_timed(step, iters)

    def sync(self) -> None: ...
    def barrier(self) -> None: ...


@pytest.mark.parametrize("warmup", [0, 2])
def test_measure_writes_the_pattern_into_the_inputs_before_the_first_call(warmup: int) -> None:
    """An input left as fresh zeros reads the kernel's zero page and times faster than real data."""
    from hpcdist.bench.measure import measure

    path = _RecordingPath()
    c = counts("all_reduce", 4 * 1000, 1, 4)
    measure(path, "all_reduce", c, "out_of_place", "float32", warmup, 3, check=False)  # type: ignore[arg-type]
    want = np.asarray(pattern.values(AX, 0, 0, c.count), dtype=np.float32)
    assert len(path.seen) == warmup + 3
    assert np.array_equal(path.seen[0], want)
    assert np.array_equal(path.seen[warmup], want)  # the first timed call

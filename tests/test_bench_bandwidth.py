"""The factor table and size arithmetic against figures worked out by hand (nccl-tests' PERFORMANCE.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcdist.bench.bandwidth import algbw, bus_factor, busbw, counts, human_bytes, parse_size, sweep


@pytest.mark.parametrize(
    ("op", "nranks", "factor"),
    [
        ("all_reduce", 2, 1.0),  # 2 * 1 / 2
        ("all_reduce", 8, 1.75),  # 2 * 7 / 8
        ("all_reduce", 16, 1.875),  # 2 * 15 / 16
        ("all_gather", 4, 0.75),  # 3 / 4
        ("reduce_scatter", 8, 0.875),  # 7 / 8
        ("all_to_all", 2, 0.5),  # 1 / 2
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
        ("pingpong", 2, 1.0),
        ("all_reduce", 1, 0.0),  # one rank moves nothing over the bus
    ],
)
def test_bus_factor_matches_nccl_tests(op: str, nranks: int, factor: float) -> None:
    assert bus_factor(op, nranks) == pytest.approx(factor)


def test_algbw_and_busbw_from_bytes_and_seconds() -> None:
    # 1 GiB all_reduce in 10 ms on 8 ranks: algbw 107.374 GB/s (1e9 bytes), busbw x 1.75
    size = 1 << 30
    assert algbw(size, 0.010) == pytest.approx(107.3741824)
    assert busbw("all_reduce", size, 0.010, 8) == pytest.approx(107.3741824 * 1.75)
    # 64 MiB all_gather (total gathered) in 4 ms on 4 ranks: 16.777 GB/s algbw, 12.583 busbw
    assert busbw("all_gather", 64 << 20, 0.004, 4) == pytest.approx(16.777216 * 0.75)
    assert math.isnan(algbw(100, 0.0))


def test_counts_round_down_to_a_multiple_of_the_ranks_like_nccl_tests() -> None:
    # 100 bytes of float32 on 3 ranks: 25 elements -> 8 per rank -> 24 gathered, 96 bytes
    c = counts("all_gather", 100, 3, 4)
    assert (c.size_bytes, c.count, c.send, c.recv) == (96, 24, 8, 24)
    c = counts("reduce_scatter", 100, 3, 4)
    assert (c.size_bytes, c.send, c.recv) == (96, 24, 8)
    c = counts("all_reduce", 100, 3, 4)
    assert (c.size_bytes, c.count) == (100, 25)
    assert counts("barrier", 4096, 2, 4).size_bytes == 0


def test_sizes_parse_like_nccl_tests_flags() -> None:
    assert parse_size("8") == 8
    assert parse_size("64K") == 65536
    assert parse_size("4M") == 4 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("8MiB") == 8 << 20
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert human_bytes(4 << 20) == "4M" and human_bytes(1000) == "1000"


def test_sweep_by_factor_and_by_step() -> None:
    assert sweep(8, 64, factor=2) == [8, 16, 32, 64]
    assert sweep(8, 100, factor=4) == [8, 32]
    assert sweep(1024, 4096, factor=None, step_bytes=1024) == [1024, 2048, 3072, 4096]
    with pytest.raises(ValueError, match="below min"):
        sweep(64, 8)
    with pytest.raises(ValueError, match="positive"):
        sweep(0, 8)


@pytest.mark.parametrize(("op", "busbw_gbps"), [
    ("all_reduce", 0.75),  # algbw 0.5 x 2(4-1)/4
    ("all_gather", 0.375),  # x (4-1)/4
    ("reduce_scatter", 0.375),
    ("all_to_all", 0.375),
    ("broadcast", 0.5),  # x 1
    ("reduce", 0.5),
])
def test_a_result_row_from_known_times_on_four_ranks(op: str, busbw_gbps: float) -> None:
    """The stored row from four ranks' known iteration times: time averaged over iterations, then
    over ranks (nccl-tests), 1 MB / 2 ms = 0.5 GB/s algbw, busbw by nccl-tests' factor for 4 ranks."""
    from hpcdist.bench.measure import Local, summarize

    per_rank_ms = ([1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [1.0, 3.0])  # means 1, 2, 3, 2 ms: 2 ms overall
    locals_ = [Local(np.array(ms) * 1e-3, wrong=0) for ms in per_rank_ms]
    c = counts(op, 1_000_000, 4, 4)  # float32
    row = summarize(op, c, False, locals_, [0, 1, 2, 3], ["h0", "h1", "h2", "h3"], 4, expected_gbps=1.0)
    assert c.size_bytes == 1_000_000  # 250,000 float32 elements divide among 4 ranks
    assert row["time_us"] == pytest.approx(2000.0)
    assert row["algbw_gbps"] == pytest.approx(0.5)
    assert row["busbw_gbps"] == pytest.approx(busbw_gbps)
    assert row["fraction"] == pytest.approx(busbw_gbps)  # of the 1 GB/s expected
    assert (row["slowest_rank"], row["slowest_host"], row["slowest_time_us"]) == (2, "h2", pytest.approx(3000.0))

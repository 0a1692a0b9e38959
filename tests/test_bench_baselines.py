"""The site's minimum bus bandwidth, compared where it holds: a figure per size at that size, one
figure (a peak) at the largest size measured. The shipped ndr-h100 site as a user has it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hpcdist.bench.collectives import shortfalls, table_name
from hpcdist.config import load_site


def _session(site_name: str, rows: list[tuple[int, float]], sets: list[str] | None = None) -> Any:
    site = load_site(site_name, sets or [])
    table = SimpleNamespace(rows=[{"size": size, "busbw_gbps": bw, "slowest_rank": 9, "slowest_host": "gpu-b"}
                                  for size, bw in rows])
    path = SimpleNamespace(name="torch", label="torch/nccl")
    return SimpleNamespace(ctx=SimpleNamespace(site=site), paths=[path],
                           record=SimpleNamespace(tables={table_name("all_reduce", "torch"): table}))


def test_the_preflight_across_h100_nodes_is_not_judged_by_the_8g_peak() -> None:
    """The preflight's 1M and 16M all_reduce across nodes (latency-bound, tens of GB/s) against the
    site's figure for 8 GiB: every multi-node preflight stopped the job."""
    assert shortfalls(_session("ndr-h100", [(1 << 20, 18.0), (16 << 20, 95.0)]), ("all_reduce",)) == []


def test_a_minimum_per_size_is_compared_at_that_size() -> None:
    s = _session("ndr-h100", [(16 << 20, 95.0), (8 << 30, 250.0)])
    assert shortfalls(s, ("all_reduce",)) == [
        "all_reduce on torch/nccl: busbw 250.00 GB/s at 8G < minimum 280 GB/s (slowest rank 9 on gpu-b)"]


def test_one_figure_is_a_peak_compared_at_the_largest_size() -> None:
    s = _session("ndr-h100", [(1 << 20, 18.0), (16 << 20, 95.0)], ["baselines.min_busbw_gbps.all_reduce=100"])
    assert shortfalls(s, ("all_reduce",)) == [
        "all_reduce on torch/nccl: busbw 95.00 GB/s at 16M < minimum 100 GB/s (slowest rank 9 on gpu-b)"]

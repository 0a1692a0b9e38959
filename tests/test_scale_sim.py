"""What a rank pays in the job's store does not grow with the world size (counted, not timed):
hpcdist's real check-in, beats, roll call after one failure and check-out, simulated as in
``benchmarks/scale_sim.py`` (threads in two processes, each rank its own client of one TCPStore)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.scale_sim import one_path, parser
from hpcdist.runtime import signed_store


def _bytes_and_requests(world: int, key_file: Path) -> tuple[list[int], list[int], int]:
    """Each rank's bytes and requests over every phase but the connect (ranks 1..world-1), and rank 0's bytes."""
    args = parser().parse_args(["--procs", "2", "--per-node", "4", "--roll-call-s", "0.5", "--timeout", "60"])
    args.key_file = str(key_file)
    counts = one_path("hpcdist", world, args)["counts"]  # raises unless every rank got the right table,
    # GPU and roll-call verdict, and rank 0 saw every rank check out

    def total(r: int, i: int) -> int:
        return sum(row[i] for row in counts[r].values())

    others = range(1, world)
    return [total(r, 1) for r in others], [total(r, 0) for r in others], total(0, 1)


def test_a_ranks_store_traffic_does_not_grow_with_the_world_size(tmp_path: Path) -> None:
    """Between 16 and 128 ranks a rank's bytes stay within 10 % (the digits of longer rank numbers)
    and its requests do not grow: the host table every rank read was 8x longer at 128 ranks before
    it was packed (issue 67). Two ranks do a job for all, whichever the threads' order makes them:
    the first to answer the roll call reads every rank's keys (its bytes grow with the world, as
    rank 0's do), and the last to check in marks the count complete (one request more, at every
    size; when that was rank 0 or the roll call's reader in one run and another rank in the other,
    comparing the second-busiest ranks failed a clean-clone run)."""
    key = signed_store.make_key(tmp_path, "sim")
    small_bytes, small_requests, small_rank0 = _bytes_and_requests(16, key)
    big_bytes, big_requests, big_rank0 = _bytes_and_requests(128, key)
    small, big = sorted(small_bytes)[-3], sorted(big_bytes)[-3]  # every rank but the two with a job for all
    assert big <= 1.1 * small, (small, big)
    assert sorted(big_requests)[-3] <= sorted(small_requests)[-3], (small_requests, big_requests)
    completer = sorted(big_requests)[-2]  # one request more than the others, at any size
    assert completer <= sorted(small_requests)[-3] + 1, (small_requests, big_requests)
    assert max(big_bytes) > 4 * max(small_bytes)  # the collector's reads do grow: the count sees them
    assert big_rank0 > 4 * small_rank0

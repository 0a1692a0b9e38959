"""Every rank's host in a few bytes: the table rank 0 publishes at check-in, packed as Slurm packs
a node list.

A job's ranks sit in blocks on nodes whose names count up (``gpu-node-000001`` ... ``-002048``,
eight ranks each): rank 0 publishes runs of (name pattern, first number, nodes, ranks per node),
so the table every rank reads is a few dozen bytes whatever the world size, where the plain list
was 16 bytes per rank (300 KB at 16,384 ranks, read by every rank: 5 GB through rank 0's store).
Names that do not count up cost one run each, as they would in ``SLURM_JOB_NODELIST``: the table
is as long as the allocation's irregularity, never longer than the plain list.
``HostTable`` reads a rank's host from the runs without expanding them (a rank holds the table,
not 16,384 strings).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")  # the last number in a name, with what comes before and after

Run = tuple[str, str, str, int, int]  # head, first number as written ("" for none), tail, nodes, ranks per node


def _name(head: str, first: str, tail: str, i: int) -> str:
    return head + (str(int(first) + i).zfill(len(first)) if first else "") + tail


def pack(hosts: Sequence[str]) -> list[Run]:
    """`hosts` (rank -> host, in rank order) as runs of consecutive nodes with as many ranks each."""
    runs: list[list[Any]] = []
    i = 0
    while i < len(hosts):
        host, j = hosts[i], i
        while j < len(hosts) and hosts[j] == host:
            j += 1
        per_node = j - i
        last = runs[-1] if runs else None
        if (last is not None and last[1] and last[4] == per_node
                and _name(last[0], last[1], last[2], last[3]) == host):  # the next node of the last run
            last[3] += 1
        else:
            found = _NUMBERED.match(host)
            head, first, tail = found.groups() if found else (host, "", "")
            runs.append([head, first, tail, 1, per_node])
        i = j
    return [(str(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[4])) for r in runs]


class HostTable(Mapping[int, str]):
    """rank -> host, read from packed runs (``pack``): as a dict of every rank's host, but holding
    only the runs."""

    def __init__(self, runs: Sequence[Sequence[Any]]) -> None:
        self.runs: list[Run] = [(str(h), str(f), str(t), int(n), int(k)) for h, f, t, n, k in runs]
        self._starts: list[int] = []
        total = 0
        for run in self.runs:
            if run[3] < 1 or run[4] < 1 or (not run[1] and run[3] != 1):
                raise ValueError(f"bad run {list(run)!r} in a packed host table")
            self._starts.append(total)
            total += run[3] * run[4]
        self._len = total

    @classmethod
    def of(cls, hosts: Sequence[str]) -> HostTable:
        return cls(pack(hosts))

    def __getitem__(self, rank: int) -> str:
        if not isinstance(rank, int) or not 0 <= rank < self._len:
            raise KeyError(rank)
        at = bisect.bisect_right(self._starts, rank) - 1
        head, first, tail, _, per_node = self.runs[at]
        return _name(head, first, tail, (rank - self._starts[at]) // per_node)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._len))

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"HostTable({self.runs!r})"

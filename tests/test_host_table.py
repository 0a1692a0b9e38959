"""The host table rank 0 publishes at check-in: every rank's host, packed as Slurm packs a node list."""

from __future__ import annotations

import json

import pytest

from hpcdist.runtime.host_table import HostTable, pack


def test_a_regular_allocation_packs_to_one_run_whatever_its_size() -> None:
    hosts = [f"gpu-node-{r // 8:06d}" for r in range(16384)]
    table = HostTable(json.loads(json.dumps(pack(hosts))))  # as every rank reads it from the store
    assert table.runs == [("gpu-node-", "000000", "", 2048, 8)]
    assert len(json.dumps(pack(hosts))) < 40  # the plain list: 16,384 x 19 bytes
    assert list(table.values()) == hosts and table[8191] == "gpu-node-001023"


@pytest.mark.parametrize("hosts", [
    ["n9", "n10", "n11"],  # the width grows: still one run
    ["n09", "n10", "n11", "n11"],  # one node with two ranks ends the run
    ["n1", "n2", "n1", "n2"],  # cyclic placement
    ["login", "login", "n3.cluster.local", "n4.cluster.local", "a1b", "a2b"],
    ["7", "8", "n007", "n8", "x"],
    [],
])
def test_any_list_of_hosts_reads_back_the_same(hosts: list[str]) -> None:
    table = HostTable(pack(hosts))
    assert dict(table) == dict(enumerate(hosts)) and len(table) == len(hosts)
    with pytest.raises(KeyError):
        table[len(hosts)]

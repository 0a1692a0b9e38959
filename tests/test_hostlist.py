"""Slurm host lists and task counts, against the examples in Slurm's documentation."""

import pytest

from hpcdist.scheduler.hostlist import expand_hostlist, expand_tasks_per_node


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        # sbatch(1) / scontrol(1) examples
        ("tux[1,3-5]", ["tux1", "tux3", "tux4", "tux5"]),
        ("lx[10-12]", ["lx10", "lx11", "lx12"]),
        ("linux[00-02]", ["linux00", "linux01", "linux02"]),
        ("n[1-2]", ["n1", "n2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("gpu-[001-003],cpu7", ["gpu-001", "gpu-002", "gpu-003", "cpu7"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("single", ["single"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("", []),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[5-2]"])
def test_bad_hostlist_is_an_error(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("3,2", [3, 2]), ("1(x2)", [1, 1])],
)
def test_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts

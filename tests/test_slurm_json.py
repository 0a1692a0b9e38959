"""Discovery on Slurm's JSON and on a live controller of real clusters' shapes (issue 63, item 3):
``scontrol --json show node`` where the release prints it (24.11 does, Debian's 22.05 does not)
gives the nodes its text gives, and read_cluster asks it first; tests/fixtures/slurm/
shapes-24.11-live is a Slurm 24.11 controller configured with the shapes of real clusters, captured
as user alice (its README), read into the site a user would get."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hpcdist.config import safe_load, validate
from hpcdist.config.discovered import site_text
from hpcdist.config.site import Site
from hpcdist.scheduler import slurm, slurm_cluster, slurm_text
from hpcdist.scheduler.slurm_text import nodes_json
from tests.support.slurm_fixtures import FIXTURES, cluster, text

LIVE = "shapes-24.11-live"
WITH_JSON = sorted(p.parent.name for p in FIXTURES.glob("*/node.json"))


def by_name(nodes: list[slurm_text.Node] | None) -> dict[str, tuple[Any, ...]]:
    """Each node's facts, its state as a set of words (the JSON lists them in another order)."""
    assert nodes
    return {n.name: (n.cpus, n.cpus_total, n.memory_mb, n.memory_spec_mb, n.gpus, n.gpu_type, n.gpu_types,
                     n.gpus_shared, n.features, n.partitions, frozenset(n.state.split("+")), n.in_service)
            for n in nodes}


@pytest.mark.parametrize("folder", WITH_JSON)
def test_the_nodes_of_the_json_are_the_nodes_of_the_text(folder: str) -> None:
    assert {"24.11-r2411", "26.05-r2605", LIVE} <= set(WITH_JSON)
    assert by_name(nodes_json(text(folder, "node.json"))) == by_name(slurm_text.nodes(text(folder, "node.txt")))


def test_what_is_not_json_of_nodes_leaves_the_text_to_be_read() -> None:
    usage = "scontrol: unrecognized option '--json'\nTry \"scontrol --help\" for more information\n"  # 22.05
    assert nodes_json(usage) is None and nodes_json('{"errors": [{"error": "x"}]}') is None
    made = slurm_text.Texts(config=text(LIVE, "config.txt"), nodes=text(LIVE, "node.txt"),
                            partitions=text(LIVE, "partition.txt"), nodes_json=usage)
    assert [n.name for n in slurm_text.cluster_from(made, "alice").partitions[0].nodes] == ["c1", "c2", "c3", "c4"]


def fake_slurm(folder: str, asked: list[str]) -> Any:
    """slurm.run answering from fixture `folder` as that release would (22.05: no --json)."""
    files = {"show config": "config.txt", "-o show node": "node.txt", "-o show partition": "partition.txt",
             "--json show node": "node.json", "--mpi=list": "mpi_list.txt"}

    def run(argv: list[str], **_: Any) -> slurm.Answer:
        words = " ".join(argv[1:])
        asked.append(words)
        name = files.get(words)
        if name is None or not (FIXTURES / folder / name).is_file():
            return slurm.Answer(False, why=f"`{argv[0]}` exited 1")
        return slurm.Answer(True, text(folder, name))
    return run


@pytest.mark.parametrize(("folder", "json_read"), [("24.11-r2411", True), ("26.05-r2605", True), (LIVE, True),
                                                   ("22.05-hpcdist", False)])
def test_read_cluster_asks_for_json_first(folder: str, json_read: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(slurm, "run", fake_slurm(folder, asked))
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda _: None)  # no srun --help
    monkeypatch.setenv("USER", "alice")
    read = slurm_cluster.read_cluster()
    assert asked.index("--json show node") < asked.index("-o show partition")
    assert ("-o show node" in asked) is not json_read  # the text only where the JSON is not there
    assert by_name([n for p in read.partitions for n in p.nodes]) == \
        by_name([n for p in cluster(folder).partitions for n in p.nodes])


# ---------------------------------------------------------------- a 24.11 controller of real clusters' shapes


def test_a_live_controllers_shapes_make_the_site_a_user_expects() -> None:
    made = site_text(cluster(LIVE), "campus")
    data = safe_load(made)
    validate(Site, {**data, "name": "campus"}, "campus.yaml")
    parts = data["partitions"]
    assert (parts["cpu"]["nodes"], parts["cpu"]["cpus_per_node"], parts["cpu"]["mem_gb"]) == (2, 62, 494.9)
    assert "c3 DOWN, c4 IDLE+DRAIN left out" in made  # c4's Reason holds Gres=gpu:8: no GPU of it counted
    assert "mem_gb" not in parts["3090"] and (parts["3090"]["gpus_per_node"], parts["3090"]["gpu_type"]) == \
        (8, "rtx3090")
    assert (parts["on"]["cpus_per_node"], parts["on"]["mem_gb"]) == (32, 125.0)  # MaxCPUsPerNode, MaxMemPerCPU
    assert parts["mig"]["gpus_per_node"] == 9 and "gpu_type" not in parts["mig"]
    assert "Gres=gpu:no_consume" in made and "gpu_type" not in parts["shared"]
    assert "partition 2019: not written: State=INACTIVE" in made and "partition maint: not written: State=DOWN" in made
    assert parts["wide"]["cpus_per_node"] == 8 and data["defaults"]["partition"] == "cpu"


def test_what_the_live_controller_showed_that_the_hand_written_shapes_did_not() -> None:
    """24.11 as it is: a FUTURE node is not in ``scontrol show node`` (f1 is configured), a
    partition her groups may not use is not in ``scontrol show partition`` (mixed, AllowGroups=
    ml-staff), nor its node x1 in ``show node``; nodes a MAINT reservation holds are
    IDLE+MAINTENANCE+RESERVED and take jobs of the reservation; and a partition's JSON has no
    Default, so partitions are read from text."""
    live = cluster(LIVE)
    shown = text(LIVE, "node.txt") + text(LIVE, "node.json")
    assert "f1" not in {n.name for p in live.partitions for n in p.nodes} and '"f1"' not in shown
    assert "mixed" not in {p.name for p in live.partitions} and '"x1"' not in shown and "NodeName=x1" not in shown
    c1 = next(n for n in live.partitions[0].nodes if n.name == "c1")
    assert set(c1.state.split("+")) == {"IDLE", "MAINTENANCE", "RESERVED"} and c1.in_service
    for folder in ("24.11-r2411", LIVE):  # 26.05's (data_parser v0.0.45) has "flags": ["DEFAULT"]
        parts = json.loads(text(folder, "partition.json"))["partitions"]
        assert not any("flags" in p or "default" in json.dumps(p["partition"]).lower() for p in parts)
        assert "Default=YES" in text(folder, "partition.txt")
    assert json.loads(text("26.05-r2605", "partition.json"))["partitions"][0]["flags"] == ["DEFAULT"]

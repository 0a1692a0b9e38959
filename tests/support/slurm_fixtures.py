"""Captured Slurm text (tests/fixtures/slurm/): one folder per cluster, one file per command, as
tests/fixtures/slurm/capture.sh writes them; read into the ``Cluster`` discovery makes of them."""

from __future__ import annotations

from hpcdist.scheduler.slurm_text import Cluster, Texts, cluster_from
from tests.support.cli import REPO

FIXTURES = REPO / "tests" / "fixtures" / "slurm"
FILES = {"config": "config.txt", "nodes": "node.txt", "partitions": "partition.txt", "mpi_list": "mpi_list.txt",
         "assoc": "assoc.txt", "user": "user.txt", "qos": "qos.txt", "nodes_json": "node.json"}
NO_ACCOUNTING = "Only 'accounting_storage/slurmdbd' is supported"  # what sacctmgr says on a cluster without


def text(folder: str, name: str) -> str:
    path = FIXTURES / folder / name
    return path.read_text() if path.is_file() else ""


def texts(folder: str, **replaced: str) -> Texts:
    """The commands' text of fixture `folder`, with `replaced` files' text in their place; its
    node.json too where it has one, as discovery reads it first (not where `replaced` has nodes)."""
    found = {key: replaced.get(key, text(folder, name)) for key, name in FILES.items()}
    if "nodes" in replaced and "nodes_json" not in replaced:
        found["nodes_json"] = ""
    config = found["config"]
    answered = "accounting_storage/slurmdbd" in config and NO_ACCOUNTING not in found["assoc"]
    return Texts(config=config, nodes=found["nodes"], partitions=found["partitions"], mpi_list=found["mpi_list"],
                 assoc=found["assoc"] if answered else None, user=found["user"], qos=found["qos"],
                 nodes_json=found["nodes_json"])


def cluster(folder: str, user: str = "alice", groups: tuple[str, ...] = ("alice",), **replaced: str) -> Cluster:
    return cluster_from(texts(folder, **replaced), user, groups)


def releases() -> list[str]:
    """The folders captured from the test bed's running clusters (a version.txt from ``scontrol
    --version``); not shapes-24.11-live, a controller of real clusters' shapes captured alike."""
    return sorted(p.parent.name for p in FIXTURES.glob("*/version.txt")
                  if (p.parent / "node.txt").is_file() and not p.parent.name.startswith("shapes"))

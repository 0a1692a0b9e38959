"""Captured Slurm text (tests/fixtures/slurm/): one folder per cluster, one file per command, as
tests/fixtures/slurm/capture.sh writes them; read into the ``Cluster`` discovery makes of them."""

from __future__ import annotations

from hpcdist.scheduler.slurm_text import Cluster, Texts, cluster_from
from tests.support.cli import REPO

FIXTURES = REPO / "tests" / "fixtures" / "slurm"
FILES = {"config": "config.txt", "nodes": "node.txt", "partitions": "partition.txt", "mpi_list": "mpi_list.txt",
         "assoc": "assoc.txt", "user": "user.txt", "qos": "qos.txt"}
NO_ACCOUNTING = "Only 'accounting_storage/slurmdbd' is supported"  # what sacctmgr says on a cluster without


def text(folder: str, name: str) -> str:
    path = FIXTURES / folder / name
    return path.read_text() if path.is_file() else ""


def texts(folder: str, **replaced: str) -> Texts:
    """The commands' text of fixture `folder`, with `replaced` files' text in their place."""
    found = {key: replaced.get(key, text(folder, name)) for key, name in FILES.items()}
    config = found["config"]
    answered = "accounting_storage/slurmdbd" in config and NO_ACCOUNTING not in found["assoc"]
    return Texts(config=config, nodes=found["nodes"], partitions=found["partitions"], mpi_list=found["mpi_list"],
                 assoc=found["assoc"] if answered else None, user=found["user"], qos=found["qos"])


def cluster(folder: str, user: str = "alice", groups: tuple[str, ...] = ("alice",), **replaced: str) -> Cluster:
    return cluster_from(texts(folder, **replaced), user, groups)


def releases() -> list[str]:
    """The folders captured from a running Slurm (a version.txt from ``scontrol --version``)."""
    return sorted(p.parent.name for p in FIXTURES.glob("*/version.txt") if (p.parent / "node.txt").is_file())

"""Discovery on captured Slurm text (issue 63, item 3): each release this machine's test bed runs
(tests/fixtures/slurm/22.05-*, captured by capture.sh) and the shapes of real clusters written as
their commands print them (shapes-24.11, mpi-20.11, mpi-21.08), read by ``slurm_text`` and
written by ``site_text`` into a site that loads; each shape is a value a user would otherwise
have got wrong."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from hpcdist.config import ConfigError, load_site, safe_load, validate
from hpcdist.config.discovered import REREAD_S, _fresh, site_text, to_json
from hpcdist.config.site import Site
from hpcdist.scheduler import slurm_now, slurm_text
from tests.support.slurm_fixtures import FIXTURES, cluster, releases, text

SHAPES = "shapes-24.11"


def site_of(folder: str, **replaced: str) -> tuple[dict[str, Any], str]:
    """The site discovery writes for fixture `folder`: its YAML as data (validated as a Site) and as text."""
    made = site_text(cluster(folder, **replaced), "t")
    data = safe_load(made)
    validate(Site, {**data, "name": "t"}, "t.yaml")
    return data, made


def nodes(folder: str = SHAPES) -> dict[str, slurm_text.Node]:
    return {n.name: n for n in slurm_text.nodes(text(folder, "node.txt"))}


# ---------------------------------------------------------------- the test bed's releases, as captured


def test_every_captured_release_is_here() -> None:
    assert {"22.05-hpcdist", "22.05-parts", "22.05-gpus", "22.05-noacct", "24.11-r2411", "26.05-r2605"} <= \
        set(releases())


@pytest.mark.parametrize("folder", releases())
def test_each_captured_cluster_makes_a_site_that_loads(folder: str) -> None:
    data, _ = site_of(folder)
    assert data["partitions"] and data["defaults"]["partition"] in data["partitions"]
    assert all(p["cpus_per_node"] >= 1 and p["mem_gb"] > 0 for p in data["partitions"].values())


def test_the_captured_clusters_say_what_their_set_up_made_them() -> None:
    main, _ = site_of("22.05-hpcdist")
    assert main["partitions"]["cpu"] == {"nodes": 4, "cpus_per_node": 8, "mem_gb": 9.7, "gpus_per_node": 4,
                                         "max_time_min": 60}
    assert main["launcher"]["args"] == {"srun": ["--mpi=pmix"]}
    gpus, _ = site_of("22.05-gpus")
    part = gpus["partitions"]["gpu"]
    assert (part["gpu_type"], part["gpus_per_node"], part["gpu_nodes"]) == ("a100", 2, 1)
    # associations read with cluster=: proj-b on gpus, never the main cluster's root
    assert (gpus["account"], gpus["qos"], gpus["qos_max_time_min"]) == ("proj-b", "v-short", 20)
    noacct, made = site_of("22.05-noacct")
    assert "account" not in noacct and "accounting does not answer" in made
    parts, made = site_of("22.05-parts")  # alice has no association on parts: none is borrowed from another
    assert "account" not in parts and "you have no association on cluster parts" in made
    r2411, made = site_of("24.11-r2411")  # cluster/releases.sh's Slurm 24.11
    assert r2411["partitions"]["main"] == {"nodes": 2, "cpus_per_node": 4, "mem_gb": 3.9, "gpus_per_node": 0,
                                           "max_time_min": 60}
    assert r2411["launcher"]["args"] == {"srun": ["--mpi=pmix"]} and r2411["account"] == "root"
    # an unset MpiDefault, which 24.11 prints as (null) where 22.05 printed none
    assert "MpiDefault=none; srun --mpi=list: none, pmix, cray_shasta, pmi2, pmix_v5" in made


@pytest.mark.parametrize("folder", [f for f in releases() if (FIXTURES / f / "node.json").is_file()])
def test_the_text_read_says_what_the_releases_json_says(folder: str) -> None:
    """Where a release prints --json (24.11 does; Debian's 22.05 does not), the nodes and partitions
    read from its text are those of its JSON: names, CPUs, memory, partitions, MaxTime."""
    as_json = json.loads((FIXTURES / folder / "node.json").read_text())["nodes"]
    read = {n.name: n for n in slurm_text.nodes(text(folder, "node.txt"))}
    assert {n["name"]: (n["effective_cpus"], n["real_memory"], tuple(n["partitions"])) for n in as_json} == \
        {n.name: (n.cpus, n.memory_mb, n.partitions) for n in read.values()}
    parts = json.loads((FIXTURES / folder / "partition.json").read_text())["partitions"]
    site = cluster(folder)
    assert {p["name"]: p["maximums"]["time"]["number"] for p in parts} == \
        {p.name: p.max_time_min for p in site.partitions}


def test_the_associations_are_asked_of_this_cluster_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcdist.scheduler import slurm, slurm_cluster

    asked: list[list[str]] = []
    monkeypatch.setattr(slurm_cluster, "_ask", lambda argv: asked.append(argv) or slurm.Answer(True, "x||normal|\n"))
    slurm_cluster._accounting("alice", "gpus")
    assert "cluster=gpus" in asked[0] and asked[0][:4] == ["sacctmgr", "-n", "-P", "show"]


# ---------------------------------------------------------------- srun --mpi=list of each release


@pytest.mark.parametrize(("folder", "plugins"), [
    ("mpi-20.11", ("cray_shasta", "none", "pmi2", "pmix", "pmix_v3")),
    ("mpi-21.08", ("none", "pmix_v3", "cray_shasta", "pmi2", "pmix")),
    ("22.05-hpcdist", ("pmix", "none", "cray_shasta", "pmi2", "pmix_v4")),
    ("24.11-r2411", ("none", "pmix", "cray_shasta", "pmi2", "pmix_v5")),
    (SHAPES, ("none", "cray_shasta", "pmi2", "pmix", "pmix_v4", "pmix_v5")),
])
def test_mpi_plugins_of_every_format(folder: str, plugins: tuple[str, ...]) -> None:
    assert slurm_text.mpi_plugins(text(folder, "mpi_list.txt")) == plugins


def test_a_pmix_listed_as_srun_lines_gives_the_pmix_launcher() -> None:
    data, _ = site_of("22.05-parts", mpi_list=text("mpi-20.11", "mpi_list.txt"))
    assert data["launcher"]["args"] == {"srun": ["--mpi=pmix"]}


# ---------------------------------------------------------------- real clusters' shapes


def test_realmemory_1_writes_no_memory_and_the_site_loads() -> None:
    assert nodes()["g1"].memory_mb == 0  # Slurm's default where the admin gave none
    data, made = site_of(SHAPES)
    assert "mem_gb" not in data["partitions"]["3090"] and "RealMemory=1 on its nodes" in made


def test_partitions_named_3090_and_on_are_string_keys() -> None:
    data, made = site_of(SHAPES)
    assert "'3090':" in made and "'on':" in made
    assert {"3090", "on"} <= set(data["partitions"])  # not 3090 the int, not True
    assert data["partitions"]["3090"]["nodes"] == 2
    assert "MaxNodes=1: a job may have 1 of them (a job asking more is one line at submit)" in made


def test_a_partition_that_starts_no_job_is_not_written_and_a_numeric_one_breaks_nothing() -> None:
    data, made = site_of(SHAPES)
    assert "2019" not in data["partitions"] and "maint" not in data["partitions"]
    assert "partition 2019: not written: State=INACTIVE" in made and "partition maint: not written: State=DOWN" in made


def test_a_default_partition_her_account_may_not_use_is_not_hers() -> None:
    closed = text(SHAPES, "partition.txt").replace("PartitionName=cpu AllowGroups=ALL AllowAccounts=ALL",
                                                   "PartitionName=cpu AllowGroups=ALL AllowAccounts=physics")
    data, made = site_of(SHAPES, partitions=closed)
    assert data["defaults"]["partition"] == "3090"
    assert "Slurm's default partition 'cpu' has AllowAccounts=physics: account 'ml-lab' may not use it; the first " \
           "yours may use" in made


def test_a_cluster_with_no_partition_running_is_one_line() -> None:
    down = text(SHAPES, "partition.txt").replace("State=UP", "State=DOWN")
    with pytest.raises(ConfigError, match="the Slurm cluster 'campus' has no partition that starts jobs"):
        site_of(SHAPES, partitions=down)


def test_mig_and_mixed_gpus_keep_every_type_and_claim_none() -> None:
    mig, mixed = nodes()["m1"], nodes()["x1"]
    assert (mig.gpus, mig.gpu_type, mig.gpu_types) == (9, None, (("1g.10gb", 7), ("3g.40gb", 2)))
    assert (mixed.gpus, mixed.gpu_type, mixed.gpu_types) == (6, None, (("a100", 4), ("v100", 2)))
    data, made = site_of(SHAPES)
    assert "gpu_type" not in data["partitions"]["mixed"] and "gpu:a100:4, gpu:v100:2" in made
    assert data["partitions"]["mixed"]["gpus_per_node"] == 6


def test_no_consume_is_a_flag_not_a_type() -> None:
    shared = nodes()["s1"]
    assert (shared.gpus, shared.gpu_type, shared.gpus_shared) == (4, None, True)
    assert slurm_text.gres_gpus("gpu:tesla:no_consume:2") == (2, (("tesla", 2),), True)


def test_a_reason_holding_gres_does_not_replace_the_nodes_own() -> None:
    drained = nodes()["c4"]
    assert "Gres=gpu:8" in text(SHAPES, "node.txt").splitlines()[3] and drained.gpus == 0


def test_cpus_and_memory_are_what_slurm_gives_a_job() -> None:
    c1 = nodes()["c1"]
    assert (c1.cpus, c1.cpus_total, c1.memory_mb) == (62, 64, 515000 - 8192)  # CPUEfctv; less MemSpecLimit
    # before 22.05 there is no CPUEfctv: CPUTot less CoreSpecCount's cores
    old = text(SHAPES, "node.txt").splitlines()[0].replace("CPUEfctv=62 ", "")
    old = old.replace("ThreadsPerCore=1", "ThreadsPerCore=2")
    assert slurm_text.nodes(old)[0].cpus == 64 - 2 * 2
    data, _ = site_of(SHAPES)
    assert data["partitions"]["cpu"]["cpus_per_node"] == 62
    assert data["partitions"]["on"]["cpus_per_node"] == 32  # MaxCPUsPerNode=32
    assert data["partitions"]["on"]["mem_gb"] == 125.0  # MaxMemPerCPU=4000 x 32


def test_down_drained_and_future_nodes_are_not_counted() -> None:
    states = {n.name: n.in_service for n in nodes().values()}
    assert [name for name, ok in states.items() if not ok] == ["c3", "c4", "f1", "o1"]
    data, made = site_of(SHAPES)
    cpu = data["partitions"]["cpu"]
    assert (cpu["nodes"], cpu["cpus_per_node"]) == (2, 62)  # f1's CPUTot=1 sets nothing
    assert "c3 DOWN+NOT_RESPONDING, c4 IDLE+DRAIN, f1 FUTURE left out" in made


def test_the_partitions_own_qos_holds_its_jobs() -> None:
    mig, _ = site_of(SHAPES)
    part = mig["partitions"]["mig"]
    assert (part["nodes"], part["gpus_per_node"], part["max_time_min"]) == (1, 9, 120)  # the wall caps its time
    limits = cluster(SHAPES).qos_limits["gpu-debug"]
    assert limits.max_tres_per_user == {"gres/gpu": "4"} and limits.max_jobs_per_user == 2


def test_site_check_passes_what_discovery_wrote_and_judges_nodes_in_service() -> None:
    from hpcdist.login.site_check import _partition_claims

    live = cluster(SHAPES)
    site = validate(Site, {**site_of(SHAPES)[0], "name": "t"}, "t.yaml")
    parts = {p.name: p for p in live.partitions}
    claims = [c for name, part in site.partitions.items() for c in _partition_claims(name, part, parts[name], live)]
    assert [c.line("t") for c in claims if c.ok is False] == []
    cpu = next(c for c in claims if c.key == "partitions.cpu.cpus_per_node")
    assert cpu.cluster.startswith("gives a job 62 (CPUEfctv")
    assert "partitions.3090.mem_gb" not in [c.key for c in claims]  # RealMemory=1: no claim to judge


@pytest.mark.parametrize("folder", [*releases(), SHAPES])
def test_sinfo_names_each_node_once_with_its_partitions_and_what_is_dead(folder: str) -> None:
    states = slurm_now.node_statuses(text(folder, "sinfo.txt"))
    # sinfo leaves FUTURE nodes out unless asked (--future), as discovery does not ask
    assert set(states) == {n.name for n in nodes(folder).values() if n.state != "FUTURE"}
    if folder == SHAPES:
        assert states["c1"].partitions == ("cpu", "maint", "on")
        assert states["c4"].reason.startswith("replaced HCA, Gres=")
        assert sorted(n for n, s in states.items() if s.dead) == ["c3", "c4", "o1"]
        assert states["c3"].failed and not states["c2"].failed


# ---------------------------------------------------------------- the cached reading


def test_a_cached_reading_is_read_again_after_a_bounded_time(tmp_path: Path) -> None:
    path = tmp_path / "campus.yaml"
    path.write_text(site_text(cluster(SHAPES), "campus", cached=True))
    stamp = cluster(SHAPES).as_of
    assert not _fresh(path, stamp)  # no facts beside it (an older hpcdist's reading)
    path.with_suffix(".json").write_text(to_json(cluster(SHAPES)))
    assert _fresh(path, stamp)
    assert not _fresh(path, "sha1-0123456789abcdef")  # slurm.conf changed
    old = time.time() - REREAD_S - 1
    os.utime(path, (old, old))
    assert not _fresh(path, stamp)  # an account added in sacctmgr shows within REREAD_S
    path.write_text(path.read_text().replace("(hpcdist ", "(hpcdist 0.0.0-older "))
    assert not _fresh(path, stamp)


@pytest.mark.parametrize("folder", ["22.05-hpcdist", "24.11-r2411", "26.05-r2605"])
def test_the_configuration_stamp_is_what_slurm_conf_says_not_when_it_was_asked(folder: str) -> None:
    """scontrol's first line is the time of its answer on every release, and it ends with a ping of
    the controllers: neither is the configuration, so neither changes the stamp; MaxArraySize does."""
    said = text(folder, "config.txt")
    later = "\n".join(["Configuration data as of 2031-01-01T00:00:00", *said.splitlines()[1:],
                       "Slurmctld(primary) at elsewhere is DOWN"])
    later = re.sub(r"NEXT_JOB_ID( +)= \d+", r"NEXT_JOB_ID\1= 4242", later)  # a job submitted since
    assert "NEXT_JOB_ID             = 4242" in later
    assert slurm_text.as_of(later) == slurm_text.as_of(said) and slurm_text.as_of(said).startswith("sha1-")
    smaller = said.replace("MaxArraySize            = 1001", "MaxArraySize            = 11")
    assert slurm_text.as_of(smaller) != slurm_text.as_of(said)
    assert cluster(folder).max_array_size == 1001


def test_a_reading_that_does_not_load_is_named_as_hpcdists_not_hers(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = tmp_path / "hpcdist" / "sites" / "campus.yaml"
    cached.parent.mkdir(parents=True)
    cached.write_text(site_text(cluster(SHAPES), "campus", cached=True).replace("'3090':", "3090:"))
    with pytest.raises(ConfigError) as caught:
        load_site(str(cached))
    said = str(caught.value)
    assert said.startswith("hpcdist could not express the Slurm cluster 'campus' as a site (its own reading, not "
                           "a file of yours"), said
    assert "partitions.3090" in said and not cached.exists()  # read again at the next command

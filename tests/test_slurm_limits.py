"""What the cluster says is its limit, checked before sbatch in one line in its own words (issue 63,
item 3), on the captured shapes of tests/fixtures/slurm/shapes-24.11: a partition's MaxNodes,
AllowAccounts, DenyAccounts, AllowGroups and its own QoS, a QOS's MaxTRESPerJob and
MaxSubmitJobsPerUser; and a partition whose nodes differ judges a job against the nodes that can
hold it, not its smallest node."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist.config import load_site, read_spec
from hpcdist.config.discovered import site_text, to_json
from hpcdist.errors import SubmitError
from hpcdist.login.limits import Ask, problems
from tests.support.cli import REPO
from tests.support.slurm_fixtures import cluster

SHAPES = "shapes-24.11"


def said(ask: Ask, groups: tuple[str, ...] = ("alice",)) -> list[str]:
    return problems(cluster(SHAPES, groups=groups), ask)


@pytest.mark.parametrize(("ask", "line"), [
    (Ask("3090", nodes=2), "partition '3090' has MaxNodes=1: the job asks 2 nodes"),
    (Ask("3090", nodes=1, account="physics"), "partition '3090' has AllowAccounts=vision,ml-lab: account 'physics' "
                                              "may not use it"),
    (Ask("on", nodes=1, account="guests"), "partition 'on' has DenyAccounts=guests: account 'guests' may not use it"),
    (Ask("mixed", nodes=1), "partition 'mixed' has AllowGroups=ml-staff: user alice is in none of them "
                            "(her groups: alice)"),
    (Ask("mig", nodes=1, tasks_per_node=4, gpus_per_node=4), "the partition's QoS 'gpu-debug' has "
                                                             "MaxTRESPerJob=gres/gpu=2: the job asks gres/gpu=4"),
    (Ask("cpu", nodes=1, tasks_per_node=62, qos="gpu-debug"), "QOS 'gpu-debug' has MaxTRESPerJob=cpu=32: the job "
                                                              "asks cpu=62"),
    (Ask("cpu", nodes=1, qos="gpu-debug", array_tasks=5), "QOS 'gpu-debug' has MaxSubmitJobsPerUser=4: the array "
                                                          "has 5 tasks"),
    (Ask("mig", nodes=1, time_min=180), "the partition's QoS 'gpu-debug' has MaxWall=120 min: the job asks 180 min"),
], ids=["max-nodes", "allow-accounts", "deny-accounts", "allow-groups", "partition-qos", "qos-per-job",
        "qos-submit", "partition-qos-wall"])
def test_each_limit_is_one_line_in_the_clusters_words(ask: Ask, line: str) -> None:
    assert said(ask) == [line]


def test_what_the_limits_allow_passes() -> None:
    assert said(Ask("3090", nodes=1, tasks_per_node=8, gpus_per_node=8, gpu_type="rtx3090")) == []
    assert said(Ask("mixed", nodes=1), groups=("alice", "ml-staff")) == []
    assert said(Ask("mig", nodes=1, tasks_per_node=2, gpus_per_node=2)) == []


def test_a_partition_whose_nodes_differ_judges_the_nodes_that_can_hold_the_job() -> None:
    assert said(Ask("wide", nodes=1, tasks_per_node=8)) == []  # w1 has 8, w2 4: the job goes to w1
    (line,) = said(Ask("wide", nodes=2, tasks_per_node=8))
    assert line.startswith("partition 'wide' has 1 node in service with 8 CPUs a node, the job asks 2 (w1: 8 CPUs")
    assert said(Ask("mixed", nodes=1, tasks_per_node=4, gpus_per_node=4, gpu_type="a100"), ("ml-staff",)) == []
    (typed,) = said(Ask("mixed", nodes=1, tasks_per_node=4, gpus_per_node=4, gpu_type="v100"), ("ml-staff",))
    assert "0 nodes in service with 4 CPUs and 4 GPUs of type v100 a node" in typed
    site = site_text(cluster(SHAPES), "t")
    assert "cpus_per_node: 8" in site and "its nodes differ; a job is judged at submit" in site


def test_a_feature_no_node_has_is_named() -> None:
    assert said(Ask("cpu", nodes=1, constraint="cascadelake&ib")) == []
    assert said(Ask("cpu", nodes=1, constraint="h100")) == [
        "no node of partition 'cpu' has the feature 'h100' the constraint names (AvailableFeatures of its nodes: "
        "cascadelake, ib)"]


def test_the_ask_is_what_sbatch_is_given() -> None:
    ask = Ask.of((("partition", "gpu"), ("nodes", 2), ("ntasks-per-node", 4), ("cpus-per-task", 8),
                  ("gpus-per-node", "a100:4"), ("mem", "64000M"), ("account", "proj"), ("qos", "long"),
                  ("array", "0-9%2"), ("constraint", "ib")))
    assert ask == Ask("gpu", 2, 4, 8, 4, "a100", 64000, "proj", "long", 10, "ib")
    assert Ask.of((("partition", "p"), ("time", "1-00:00:00"))).time_min == 1440
    assert Ask.of((("partition", "p"), ("gres", "gpu:2"))).gpus_per_node == 2


def test_submit_refuses_it_before_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: a job on the discovered cluster's facts (its cached reading) is one SubmitError."""
    from hpcdist.config import discovered
    from hpcdist.login.plan import Origin, make
    from hpcdist.login.site_check import against_cluster

    facts = cluster(SHAPES)
    reading = tmp_path / "campus.yaml"
    reading.write_text(site_text(facts, "campus", cached=True))
    reading.with_suffix(".json").write_text(to_json(facts))
    monkeypatch.setattr(discovered, "discovered_site", lambda: reading)
    site = load_site(str(reading), [f"storage.{r}={tmp_path}/{r}" for r in ("results", "checkpoints", "scratch",
                                                                             "logs")])
    def refused(*sets: str) -> str:
        spec = read_spec(REPO / "jobs" / "smoke.yaml", list(sets))
        with pytest.raises(SubmitError) as caught:
            against_cluster(make(spec, site, Origin("smoke.yaml", "campus")))
        assert str(caught.value).endswith("so sbatch would refuse it or leave it pending for ever (`hpcdist site "
                                          "check campus` compares the site with the cluster)")
        return str(caught.value)

    wide = refused("resources.partition=wide", "resources.nodes=2", "resources.tasks_per_node=8")
    assert wide.startswith("job 'smoke': partition 'wide' has 1 node in service with 8 CPUs a node, the job asks 2")
    limit = refused("resources.partition='3090'", "resources.nodes=2", "resources.tasks_per_node=1")
    assert limit.startswith("job 'smoke': partition '3090' has MaxNodes=1: the job asks 2 nodes")


def test_a_cpu_job_where_only_some_nodes_have_gpus_is_not_told_to_ask_for_them(tmp_path: Path) -> None:
    from hpcdist.login.plan import Origin, make

    def note(folder: str) -> str:
        reading = tmp_path / f"{folder}.yaml"
        reading.write_text(site_text(cluster(folder), folder))
        site = load_site(str(reading), [f"storage.{r}={tmp_path}/{r}" for r in ("results", "checkpoints", "scratch",
                                                                                 "logs")])
        return make(read_spec(REPO / "jobs" / "smoke.yaml"), site, Origin("smoke.yaml", folder)).gpu_note

    assert note("22.05-gpus") == ""  # g1 has GPUs, g2 none: a CPU job is a CPU job there
    assert note("22.05-hpcdist").startswith("this job asks no GPUs on partition cpu, which has 4 a node")


@pytest.mark.parametrize(("folder", "reason", "note"), [
    (SHAPES, "ReqNodeNotAvail, Reserved for maintenance",
     "reservation 'maint-june' (Flags=MAINT,SPEC_NODES) holds c[1-2] until 2025-06-02T18:00:00"),
    (SHAPES, "Priority", ""),
    ("22.05-noacct", "ReqNodeNotAvail, Reserved for maintenance",
     "reservation 'hpcdist-fixture-maint' (Flags=MAINT,IGNORE_JOBS,SPEC_NODES,ALL_NODES) holds q[1-2] from "
     "2030-01-06T06:00:00 to 2030-01-06T18:00:00"),
    ("22.05-hpcdist", "ReqNodeNotAvail, Reserved for maintenance", ""),
])
def test_a_job_waiting_behind_a_reservation_is_told_which_and_until_when(folder: str, reason: str, note: str) -> None:
    from hpcdist.login.watch import reservation_note
    from hpcdist.scheduler.slurm_now import reservations
    from tests.support.slurm_fixtures import text

    assert reservation_note(reason, reservations(text(folder, "reservation.txt"))) == note


# ---------------------------------------------------------------- what the cluster holds now


def test_her_jobs_are_read_as_squeue_prints_them() -> None:
    from hpcdist.scheduler.slurm_now import queued_jobs
    from tests.support.slurm_fixtures import text

    live = queued_jobs(text("shapes-24.11-live", "squeue.txt"))  # 24.11 as alice: an array's tasks one by one
    assert [(j.job_id, j.partition, j.state, j.cpus, j.gpus) for j in live] == [
        ("2", "3090", "PENDING", 1, 2), ("3_0", "mig", "PENDING", 1, 2), ("3_1", "mig", "PENDING", 1, 2),
        ("3_2", "mig", "PENDING", 1, 2), ("1", "wide", "RUNNING", 4, 0)]
    assert live[0].qos == ""  # (null): a cluster without accounting
    assert queued_jobs("7|normal|gpu|RUNNING|2|16|gpu:4|None\n")[0].gpus == 8  # older releases' %b, per node


def per_user_of(ask: Ask) -> tuple[list[str], list[str]]:
    from hpcdist.login.limits import per_user
    from hpcdist.scheduler.slurm_now import queued_jobs
    from tests.support.slurm_fixtures import text

    return per_user(cluster(SHAPES), ask, queued_jobs(text(SHAPES, "squeue.txt")))


def test_her_running_and_queued_jobs_count_against_the_qos_per_user_limits() -> None:
    """mig's QoS gpu-debug: MaxSubmitJobsPerUser=4, MaxJobsPerUser=2, MaxTRESPerUser=gres/gpu=4;
    she has 3 jobs in mig, 2 running with 3 GPUs."""
    refused, waits = per_user_of(Ask("mig", nodes=1, gpus_per_node=2, array_tasks=2))
    assert refused == ["the partition's QoS 'gpu-debug' has MaxSubmitJobsPerUser=4: 3 of her jobs are queued or "
                       "running under it (4101, 4102, 4103) and this one adds 2"]
    assert waits == ["the partition's QoS 'gpu-debug' has MaxJobsPerUser=2 and 2 of her jobs run under it (4101, "
                     "4102): this one waits for one to end",
                     "the partition's QoS 'gpu-debug' has MaxTRESPerUser=gres/gpu=4 and her running jobs hold "
                     "gres/gpu=3: this one (asking 2) waits for enough to end"]
    assert per_user_of(Ask("cpu", nodes=1)) == ([], [])  # QOS normal: no per-user limit
    assert per_user_of(Ask("cpu", nodes=1, qos="gpu-debug")) == ([], [])  # none of hers runs under gpu-debug


@pytest.mark.parametrize(("folder", "now", "ask", "refused", "wait"), [
    (SHAPES, "2025-06-02T10:15:03", Ask("cpu", nodes=1), None,
     "reservation 'maint-june' (Flags=MAINT,SPEC_NODES) holds c[1-2] until 2025-06-02T18:00:00: 2 of the 2 nodes "
     "of partition 'cpu' that can hold it, so it waits until then"),
    (SHAPES, "2025-06-02T18:00:00", Ask("cpu", nodes=1), None, ""),  # it ended
    (SHAPES, "2025-06-05T08:30:00", Ask("3090", nodes=1, account="vision", time_min=60), None, ""),  # g2 is free
    (SHAPES, "2025-06-05T08:30:00", Ask("3090", nodes=1, account="vision", time_min=60, constraint="rtx3090"),
     None, ""),
    (SHAPES, "2025-06-02T10:15:03", Ask("cpu", nodes=1, reservation="maint"), "there is no reservation 'maint' "
     "(scontrol show reservation: maint-june, ml-lab-demo)", ""),
    (SHAPES, "2025-06-02T10:15:03", Ask("cpu", nodes=1, reservation="maint-june"), "reservation 'maint-june' has "
     "Users=root Accounts=(null): user alice (account 'ml-lab') may not use it", ""),
    (SHAPES, "2025-06-02T10:15:03", Ask("3090", nodes=1, reservation="ml-lab-demo"), None, ""),  # her account's
    ("shapes-24.11-live", "2026-11-29T04:00:00", Ask("on", nodes=2), None,
     "reservation 'maint-june' (Flags=MAINT,SPEC_NODES) holds c[1-2] until 2026-11-29T15:58:39: 2 of the 2 nodes "
     "of partition 'on' that can hold it, so it waits until then"),
    ("shapes-24.11-live", "2026-11-29T04:00:00", Ask("wide", nodes=2), None, ""),
], ids=["maint-now", "maint-ended", "other-account-later", "constraint", "unknown", "not-hers", "hers",
        "live-maint", "live-free"])
def test_a_reservation_is_named_before_sbatch(folder: str, now: str, ask: Ask, refused: str | None,
                                              wait: str) -> None:
    from datetime import datetime

    from hpcdist.login.limits import reservations
    from hpcdist.scheduler.slurm_now import reservations as read
    from tests.support.slurm_fixtures import text

    facts = cluster(folder)
    assert reservations(facts, ask, read(text(folder, "reservation.txt")), datetime.fromisoformat(now)) == \
        (refused, wait)


def test_submit_names_what_the_cluster_holds_now_before_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The wiring: against_cluster asks the reservations and her jobs (here the fixture's, as
    scontrol and squeue print them); a named reservation she may not use, or a job over
    MaxSubmitJobsPerUser, is one SubmitError; a job over MaxJobsPerUser is one line, and goes in."""
    from hpcdist.config import discovered
    from hpcdist.login.plan import Origin, make
    from hpcdist.login.site_check import against_cluster
    from hpcdist.scheduler import slurm_cluster
    from hpcdist.scheduler.slurm_now import queued_jobs, reservations
    from tests.support.slurm_fixtures import text

    facts = cluster(SHAPES)
    reading = tmp_path / "campus.yaml"
    reading.write_text(site_text(facts, "campus", cached=True))
    reading.with_suffix(".json").write_text(to_json(facts))
    monkeypatch.setattr(discovered, "discovered_site", lambda: reading)
    monkeypatch.setattr(slurm_cluster, "current_reservations",
                        lambda shared=None: reservations(text(SHAPES, "reservation.txt")))
    monkeypatch.setattr(slurm_cluster, "my_jobs", lambda user: queued_jobs(text(SHAPES, "squeue.txt")))
    site = load_site(str(reading), [f"storage.{r}={tmp_path}/{r}" for r in ("results", "checkpoints", "scratch",
                                                                             "logs")])

    def check(*sets: str) -> None:
        spec = read_spec(REPO / "jobs" / "smoke.yaml", ["resources.partition=mig", "resources.tasks_per_node=1",
                                                        *sets])
        against_cluster(make(spec, site, Origin("smoke.yaml", "campus")))

    with pytest.raises(SubmitError, match="^job 'smoke': reservation 'maint-june' has Users=root Accounts=.null.: "
                                          "user alice .account 'ml-lab'. may not use it, so sbatch would refuse it"):
        check("sbatch.reservation=maint-june")
    check("resources.gpus_per_node=1")
    assert capsys.readouterr().err.splitlines() == [
        "hpcdist: job 'smoke' will wait: the partition's QoS 'gpu-debug' has MaxJobsPerUser=2 and 2 of her jobs run "
        "under it (4101, 4102): this one waits for one to end"]
    monkeypatch.setattr(slurm_cluster, "my_jobs", lambda user: queued_jobs(text(SHAPES, "squeue.txt") * 2))
    with pytest.raises(SubmitError, match="MaxSubmitJobsPerUser=4: 6 of her jobs are queued or running"):
        check()

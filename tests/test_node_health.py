"""The site remembers bad nodes (issue 24): the health record on shared storage, its writers
(the preflight, a job's post-mortem) and its readers (every submit's ``--exclude``, ``hpcdist nodes``)."""

from __future__ import annotations

import json
import multiprocessing
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcdist.bench.pairs import culprits
from hpcdist.bench.record import Matrix
from hpcdist.scheduler.slurm_cluster import node_states
from hpcdist.store.records import health
from hpcdist.store.results import read_attrs
from tests.netfault import slowed
from tests.support.cli import REPO, job_id, result_path, run_cli, storage_sets

JOBS = REPO / "jobs"

WRITERS, MARKS_EACH = 6, 25


def _write_marks(folder: str, writer: int) -> None:
    for i in range(MARKS_EACH):
        health.mark(Path(folder), f"n{writer}", f"slow link, mark {i}", f"{100 + writer}_{i}", "preflight")


def test_concurrent_marks_from_several_processes_are_all_kept_and_whole(tmp_path: Path) -> None:
    folder = tmp_path / "node-health"
    ctx = multiprocessing.get_context("fork")  # real processes, without importing hpcdist again in each
    procs = [ctx.Process(target=_write_marks, args=(str(folder), w)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    files = sorted(folder.iterdir())
    assert len(files) == WRITERS * MARKS_EACH  # none lost, no temporary left behind
    for f in files:
        assert json.loads(f.read_text())["source"] == "preflight"  # every file whole
        assert stat.S_IMODE(f.stat().st_mode) == 0o640  # the group reads a mark; only its author writes it
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750  # a record of one's own (a shared one is the admin's)
    bad = health.bad_nodes(folder, within_s=3600)
    assert [m.node for m in bad] == [f"n{w}" for w in range(WRITERS)]
    assert bad[0].reason == f"slow link, mark {MARKS_EACH - 1}" and bad[0].job_id == f"100_{MARKS_EACH - 1}"
    assert health.clear(folder, "n0").removed == MARKS_EACH
    assert "n0" not in [m.node for m in health.bad_nodes(folder, within_s=3600)]


def test_marks_expire_by_age_and_a_job_marks_a_node_once(tmp_path: Path) -> None:
    first = health.mark(tmp_path, "n3", "NODE_FAIL", "41", "node_failure")
    assert health.mark(tmp_path, "n3", "NODE_FAIL again", "41", "node_failure") == first  # a second waiter
    time.sleep(0.3)
    health.mark(tmp_path, "n4", "slow", "42", "preflight")
    assert [m.node for m in health.bad_nodes(tmp_path, within_s=0.2)] == ["n4"]  # n3's mark is older
    assert health.bad_nodes(tmp_path, within_s=0) == []  # health.exclude_for_h: 0 turns exclusion off
    assert health.prune(tmp_path, older_than_s=0.2) == 1 and [m.node for m in health.marks(tmp_path)] == ["n4"]


def matrix(nodes: list[str], slow: set[str]) -> Matrix:
    """A node-pair matrix where every link touching a node in `slow` moves 0.002 GB/s, others 1."""
    n = len(nodes)
    bw = np.array([[np.nan if i == j else (0.002 if {nodes[i], nodes[j]} & slow else 1.0) for j in range(n)]
                   for i in range(n)])
    return Matrix(nodes, bw, np.ones((n, n)), bw, {"label": "torch/gloo"})


def test_the_preflight_blames_a_node_only_when_every_link_of_it_is_slow() -> None:
    four = ["n1", "n2", "n3", "n4"]
    assert list(culprits(matrix(four, {"n2"}), 0.02, None)) == ["n2"]
    assert culprits(matrix(four, set(four)), 0.02, None) == {}  # every link slow: the baseline, not a node
    assert culprits(matrix(["n1", "n2"], {"n2"}), 0.02, None) == {}  # one link: either end could be the cause
    assert culprits(matrix(four, {"n2"}), None, None) == {}  # the site sets no minimum


def test_a_slow_rail_marks_its_node_and_is_named_with_its_hca() -> None:
    """Four nodes, two rails each: rail 1 of n2 (its mlx5_3) moves 0.002 GB/s, everything else 1.
    The pair matrix (each pair's slowest rail) makes n2 the culprit as a slow node would, and the
    shortfall and the report name the rail. (A slow rail is a fake here: the test cluster's ranks
    of a node share one interface.)"""
    from hpcdist.bench.pairs import _slowest, pair_shortfalls, rail_names
    from hpcdist.bench.report import matrix_lines

    four = ["n1", "n2", "n3", "n4"]
    rails = np.stack([matrix(four, set()).bandwidth, matrix(four, {"n2"}).bandwidth])
    lat = np.ones((2, 4, 4))
    m = Matrix(four, _slowest(rails, np.fmin), _slowest(lat, np.fmax), rails[1], {"label": "torch/nccl"},
               rails=rail_names(2, ("mlx5_0", "mlx5_3")), rail_bandwidth=rails, rail_latency=lat)
    assert list(culprits(m, 0.02, None)) == ["n2"]
    (said,) = pair_shortfalls(m, 0.02, None)
    assert "n1->n2 rail 1 (mlx5_3) 0.002 GB/s" in said and "rail 0" not in said
    assert "nodes that fell short: n2 (6 links)" in said
    text = "\n".join(matrix_lines("torch", {
        "nodes": four, "bandwidth_gbps": m.bandwidth, "latency_us": m.latency, "size": 1 << 20, "latency_size": 8,
        "min_gbps": 0.02, "rails": m.rails, "rail_bandwidth_gbps": rails, "rail_latency_us": lat}))
    assert "each pair's slowest of 2 rails" in text
    rail0, rail1 = text.split("# rail 0 (mlx5_0)")[1].split("# rail 1 (mlx5_3)")
    assert "SLOW" not in rail0 and rail1.count("SLOW") == 6


# ---------------------------------------------------------------- on the Slurm cluster

SITE = ["--site", "local-slurm", "--set", "site.partitions.cpu.nodes=4"]
SLOW = ["--set", "site.baselines.min_p2p_gbps=0.02", "--set", "params.sizes_bytes=[64K]",
        "--set", "params.pair_size=256K", "--set", "params.iters=3", "--set", "params.warmup=1"]


def nodes_json(root: Path) -> dict[str, dict[str, Any]]:
    shown = run_cli("nodes", *SITE, *storage_sets(root), "--json")
    assert shown.code == 0, shown.text
    return {row["node"]: row for row in json.loads(shown.out)["nodes"]}


def cluster_nodes() -> tuple[list[str], list[str]]:
    """The cpu partition's nodes, and those of them that respond (other tests kill nodes)."""
    states = node_states()
    assert states is not None, "sinfo could not be asked"
    members = [n for n, st in sorted(states.items()) if "cpu" in st.partitions]
    return members, [n for n in members if not states[n].failed]


def test_preflight_marks_slowed_n2_and_later_submits_exclude_it(separate_hosts: Path) -> None:
    root, store = separate_hosts, storage_sets(separate_hosts)
    members, up = cluster_nodes()
    others = [n for n in up if n != "n2"][:2]
    assert "n2" in up and len(others) == 2, f"this test needs n2 and two more responding nodes; Slurm has {up}"
    pinned = sorted(["n2", *others])
    rest = [n for n in members if n not in pinned]
    with slowed("n2", rate="20mbit"):  # three nodes pinned, n2 among them: only n2 has every link slow
        pre = run_cli("submit", str(JOBS / "bench_preflight.yaml"), *SITE, *store, *SLOW, "--wait", "--wait-timeout",
                      "240", "--set", "resources.nodes=3", "--set", f"sbatch.nodelist={','.join(pinned)}")
    assert pre.code == 1 and "finished: FAILED" in pre.out, pre.text
    assert "marked n2 bad in the site's node health record" in pre.out and "runs without it" in pre.out, pre.out
    pre_id = job_id(pre.out)

    row = nodes_json(root)["n2"]  # the mark, beside Slurm's own word on n2
    assert row["excluded"] and [(m["source"], m["job_id"]) for m in row["marks"]] == [("preflight", pre_id)]
    assert "every link of n2" in row["marks"][0]["reason"] and row["slurm"]["state"] in ("idle", "mixed", "allocated")

    # the next submit keeps off n2, merged with the user's own exclude (the nodes not pinned), and says why
    own = ["--set", f"sbatch.exclude={','.join(rest)}"] if rest else []
    job = run_cli("submit", str(JOBS / "smoke.yaml"), *SITE, *store, "--set", "resources.nodes=2",
                  "--set", "resources.tasks_per_node=1", *own, "--wait", "--wait-timeout", "120")
    assert job.code == 0, job.text
    assert f"node health: excluded n2: preflight, job {pre_id}" in job.out, job.out
    runs = subprocess.run(["sacct", "-j", job_id(job.out), "-X", "-n", "-P", "--duplicates", "-o",
                           "JobID,State,NNodes,NodeList,Start,End"], capture_output=True, text=True).stdout
    assert read_attrs(result_path(job.out))["hosts"] == others, f"{job.out}\nSlurm's record of its runs:\n{runs}"

    # excluding would leave too few nodes: one line naming the mark and the way out
    too_many = ",".join([*rest, others[0]])
    short = run_cli("render", str(JOBS / "smoke.yaml"), *SITE, *store, "--set", "resources.nodes=2",
                    "--set", f"sbatch.exclude={too_many}")
    assert short.code == 2 and len(short.err.strip().splitlines()) == 1, short.text
    assert f"would leave 1 of partition cpu's {len(members)} nodes for a job of 2" in short.err
    assert f"n2: preflight, job {pre_id}" in short.err and "hpcdist nodes --clear NODE" in short.err

    cleared = run_cli("nodes", *SITE, *store, "--clear", "n2")
    assert cleared.code == 0 and "forgot 1 mark of n2" in cleared.out, cleared.text
    assert "n2" not in nodes_json(root)
    again = run_cli("render", str(JOBS / "smoke.yaml"), *SITE, *store, "--set", "resources.nodes=2",
                    "--set", f"sbatch.exclude={too_many}")
    assert again.code == 0 and f"#SBATCH --exclude={too_many}\n" in again.out and "Node health" not in again.out

"""The variant clusters of the test bed (cluster/variants.sh, issue 55 item 4: tested on clusters
that differ as real ones do), asked through their own SLURM_CONF as a user there would: each has its
own partitions, gpus has typed GPUs on one node and enforces its accounts and QOS, noacct has no
accounting. Real Slurm throughout; these tests check the test bed that later tests build on."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.support.cli import Run
from tests.support.members import require_members, run_as
from tests.support.variants import VARIANTS, require_variant, variant_env

PARTITIONS = {"parts": ["batch*", "short"], "gpus": ["gpu*"], "noacct": ["debug*"]}
NODES = {"parts": ["p1", "p2"], "gpus": ["g1", "g2"], "noacct": ["q1", "q2"]}


def slurm(name: str, *argv: str, timeout: float = 60) -> Run:
    """A Slurm command as root against variant `name`."""
    require_variant(name)
    proc = subprocess.run(argv, env={**os.environ, **variant_env(name)}, capture_output=True, text=True,
                          timeout=timeout, check=False)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def as_alice(name: str, *argv: str, user: str = "alice") -> Run:
    """A Slurm command as `user` (an ordinary account, cluster/users.sh) against variant `name`."""
    require_variant(name)
    require_members()
    return run_as(user, *argv, env=variant_env(name), timeout=60)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_answers_with_its_own_partitions_and_two_idle_nodes(name: str) -> None:
    """sinfo through the variant's SLURM_CONF names its partitions (the default starred) and its
    two nodes, none down: a client reaches the variant's controller, not the main cluster's."""
    parts = slurm(name, "sinfo", "-h", "-o", "%P")
    assert parts.code == 0, parts.text
    assert parts.out.split() == PARTITIONS[name]
    nodes = slurm(name, "sinfo", "-h", "-N", "-o", "%N %T")
    states = dict(line.split() for line in sorted(set(nodes.out.splitlines())))
    assert sorted(states) == NODES[name], nodes.text
    assert all(s.startswith(("idle", "mix", "alloc", "comp")) for s in states.values()), states


@pytest.mark.parametrize("name", VARIANTS)
def test_a_two_node_job_as_alice_runs_on_both_nodes_of_each_variant(name: str) -> None:
    """alice's `srun -N2` runs one task on each node; on gpus it is charged to proj-b (her default
    account there, no -A given) under QOS v-short, and pmix (MpiDefault there) wired its tasks."""
    ran = as_alice(name, "srun", "-N2", "-t", "2", "sh", "-c",
                   'echo "$SLURMD_NODENAME ${SLURM_JOB_ACCOUNT:-} ${SLURM_JOB_QOS:-} ${PMIX_RANK:+pmix}"')
    assert ran.code == 0, ran.text
    lines = sorted(line.split() for line in ran.out.splitlines())
    assert [line[0] for line in lines] == NODES[name], ran.text
    if name == "gpus":
        assert all(line[1:] == ["proj-b", "v-short", "pmix"] for line in lines), ran.text


def test_gpus_has_two_typed_gpus_on_g1_and_none_on_g2() -> None:
    g1 = slurm("gpus", "scontrol", "show", "node", "g1")
    assert "Gres=gpu:a100:2" in g1.out, g1.text
    g2 = slurm("gpus", "scontrol", "show", "node", "g2")
    assert "Gres=(null)" in g2.out, g2.text
    # a GPU job lands on g1, whatever it asks of the type
    job = slurm("gpus", "srun", "-t", "1", "--gres=gpu:a100:1", "printenv", "SLURMD_NODENAME")
    assert (job.code, job.out.strip()) == (0, "g1"), job.text


def test_gpus_holds_a_job_over_its_qos_wall_time_and_runs_one_within_it() -> None:
    """alice's default QOS on gpus is v-short (20 minutes at most): a 30-minute job is accepted but
    pends with QOSMaxWallDurationPerJobLimit, as on a site whose QOS does not deny at submit; a
    10-minute one is accepted for gpu at once. carol has no account there and is refused."""
    over = as_alice("gpus", "sbatch", "--parsable", "-o", "/dev/null", "-t", "30", "--wrap", "true")
    assert over.code == 0, over.text
    job = over.out.strip().split(";")[0]
    try:
        reason = ""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            reason = slurm("gpus", "squeue", "-h", "-j", job, "-o", "%T %r %q").out.strip()
            if "QOSMaxWallDurationPerJobLimit" in reason:
                break
            time.sleep(0.5)
        assert reason == "PENDING QOSMaxWallDurationPerJobLimit v-short"
    finally:
        slurm("gpus", "scancel", job)
    within = as_alice("gpus", "sbatch", "--test-only", "-t", "10", "--wrap", "true")
    assert within.code == 0 and "in partition gpu" in within.err, within.text
    carol = as_alice("gpus", "sbatch", "--test-only", "-t", "10", "--wrap", "true", user="carol")
    assert carol.code != 0 and "Invalid account" in carol.err, carol.text


@pytest.mark.parametrize(("partition", "limit", "mem"), [("batch", "00:10:00", "500M"), ("short", "00:05:00", "250M")])
def test_parts_gives_a_job_its_partitions_default_time_and_memory(partition: str, limit: str, mem: str) -> None:
    """A job that asks for neither gets the partition's DefaultTime (batch) or MaxTime (short) and
    its DefMemPerCPU, as Slurm tells the job itself."""
    job = slurm("parts", "srun", "-p", partition, "-n1", "sh", "-c", 'scontrol show job "$SLURM_JOB_ID"')
    assert job.code == 0, job.text
    assert f"TimeLimit={limit}" in job.out and f"MinMemoryCPU={mem}" in job.out, job.out


def test_noacct_has_no_accounting_so_sacct_fails() -> None:
    sacct = slurm("noacct", "sacct", "-n", "-X")
    assert sacct.code != 0
    assert "accounting storage is disabled" in sacct.text

"""Any Slurm cluster with no site config written by hand (issue 55, items 1-3), on this machine's
cluster, as an ordinary member (alice) types it: with no site named, a job goes to Slurm where
srun is on PATH (submitit's rule) and says so; ``hpcdist site init`` writes a site read from the
cluster and ``hpcdist site check`` passes it, and names a wrong claim in one line, as ``hpcdist
submit`` does before sbatch. The cluster's variants (tests/test_site_variants.py) repeat this on
clusters configured otherwise."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import require_slurm
from tests.support.members import NO_SITE_LINE, Member, member_in, require_members

pytestmark = pytest.mark.slurm

SCRIPT = """\
import socket, sys
import hpcdist

ex = hpcdist.AutoExecutor("log_%j")
print("cluster", ex.cluster, flush=True)
ex.update_parameters(timeout_min=5, slurm_partition=sys.argv[1] if len(sys.argv) > 1 else None)
job = ex.submit(socket.gethostname)
jobs = ex.map_array(lambda x: 2 * x, [1, 2, 3])
print("host", job.result(), "login", socket.gethostname())
print("array", [j.result() for j in jobs])
"""


@pytest.fixture
def alice() -> Iterator[Member]:
    require_slurm()
    require_members()
    folder = Path(f"/home/alice/t-site-{uuid.uuid4().hex[:8]}")
    try:
        yield member_in(folder, {"auto.py": SCRIPT})
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_with_no_site_named_submitit_code_and_hpcdist_submit_run_on_the_compute_nodes(alice: Member) -> None:
    ran = alice.python("auto.py")
    assert ran.code == 0, ran.err
    assert NO_SITE_LINE in ran.err and "Traceback" not in ran.err
    assert "cluster slurm" in ran.out and "array [2, 4, 6]" in ran.out
    host, login = ran.out.split("host ")[1].split()[0], ran.out.split("login ")[1].split()[0]
    assert host != login and host.startswith("n"), ran.out  # on a compute node, not where she submitted
    done = alice.hpcdist("submit", "--wait", "smoke.yaml")
    assert done.code == 0, done.err
    assert NO_SITE_LINE in done.err and "COMPLETED" in done.out + done.err
    listed = alice.hpcdist("jobs")
    assert "smoke" in listed.out and "hpcdist" in listed.out, listed.out  # recorded to the cluster's site
    # everything the discovered site decided is there to read, each value with where it came from
    shown = alice.hpcdist("sites", "--show", "slurm")
    assert shown.code == 0 and "MaxTime=60 min" in shown.out and "Default=YES" in shown.out, shown.out


def test_site_init_then_check_pass_and_a_wrong_claim_is_one_line_at_check_and_submit(alice: Member) -> None:
    made = alice.hpcdist("site", "init", "mine")
    assert made.code == 0, made.err
    path = alice.folder / ".config" / "hpcdist" / "sites" / "mine.yaml"
    text = path.read_text()
    assert "# scontrol show partition cpu: Default=YES" in text.replace("  ", " ") or "Default=YES" in text
    assert "--mpi=pmix" in text and "srun --mpi=list" in text  # the MPI plugin, with where it came from
    checked = alice.hpcdist("site", "check", "mine")
    assert checked.code == 0, checked.out + checked.err
    assert "storage" in checked.out and "two nodes and the login node see them" in checked.out, checked.out
    assert "WRONG" not in checked.out

    # a renamed partition: named by the check, and by submit before sbatch, in one line each
    path.write_text(text.replace("\n  cpu:", "\n  batch:").replace("partition: cpu", "partition: batch"))
    wrong = alice.hpcdist("site", "check", "mine")
    assert wrong.code == 1
    assert "mine: partitions.batch: the site says it exists, the cluster has no such partition" in wrong.err
    refused = alice.hpcdist("submit", "--site", "mine", "smoke.yaml")
    assert refused.code == 2 and "Traceback" not in refused.err
    assert "resources.partition: 'batch' is not possible on the Slurm cluster 'hpcdist'" in refused.err
    assert "hpcdist site check mine" in refused.err

    # GPUs the nodes do not have (a wrong account: tests/test_site_variants.py, where accounts are enforced)
    path.write_text(text.replace("gpus_per_node: 4", "gpus_per_node: 8"))
    wrong = alice.hpcdist("site", "check", "mine", "--no-storage")
    lines = [line for line in wrong.err.splitlines() if line.startswith("hpcdist: wrong:")]
    assert wrong.code == 1 and any("gpus_per_node: the site says 8" in line for line in lines), wrong.err
    gpus = alice.hpcdist("submit", "--site", "mine", "smoke.yaml", "--set", "resources.gpus_per_node=8",
                         "--set", "resources.tasks_per_node=8")
    assert gpus.code == 2 and "resources.gpus_per_node: 8 is not possible on the Slurm cluster" in gpus.err

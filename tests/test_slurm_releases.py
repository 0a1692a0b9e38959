"""Issue 63, items 1 and 2 (first step): hpcdist's front doors on each Slurm release of the test bed
(cluster/releases.sh: daemons and commands of that release), as the ordinary user alice with no
site written by hand, discovery reading the cluster: a submitit user's script (AutoExecutor submit,
result, map_array), ``hpcdist submit jobs/smoke.yaml --wait`` on 2 nodes with the srun launcher,
and ``hpcdist site init`` then ``site check``. Parametrized by release (tests/support/releases.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.members import NO_SITE_LINE, Member
from tests.support.releases import CLUSTERS, NODES, RELEASES, alice_on, release_env

pytestmark = [pytest.mark.slurm, pytest.mark.other_clusters]  # a group beside the main cluster's

# A submitit user's script, run as she would: the function's node, the SLURM_CONF and the srun its
# step finds (the release's, through the PATH the job inherited), then a job array.
SCRIPT = """\
import os, subprocess
import hpcdist

def where():
    srun = subprocess.run(["srun", "--version"], capture_output=True, text=True, check=True).stdout.split()
    return os.environ["SLURMD_NODENAME"], os.environ["SLURM_CONF"], srun[-1]

ex = hpcdist.AutoExecutor("log_%j")
ex.update_parameters(timeout_min=5)
job = ex.submit(where)
jobs = ex.map_array(lambda x: 2 * x, [1, 2])
print("where", *job.result())
print("array", [j.result() for j in jobs])
"""


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def alice(release: str) -> Iterator[Member]:
    yield from alice_on(release, "slurm", {"where.py": SCRIPT})


def test_autoexecutor_submit_result_and_map_array(release: str, alice: Member) -> None:
    ran = alice.python("where.py")
    assert ran.code == 0, ran.err
    assert NO_SITE_LINE in ran.err and "Traceback" not in ran.err, ran.err
    node, conf, srun = ran.out.split("where ")[1].split()[:3]
    assert node in NODES[release], ran.out
    assert conf == release_env(release)["SLURM_CONF"], ran.out
    assert srun.startswith(f"{release}."), ran.out  # the step's srun is the release's own
    assert "array [2, 4]" in ran.out, ran.out


def test_smoke_on_two_nodes_with_srun(release: str, alice: Member) -> None:
    smoke = alice.hpcdist("submit", "--wait", "smoke.yaml", "--set", "resources.nodes=2",
                          "--set", "site.launcher.kind=srun", timeout=300)
    assert smoke.code == 0, smoke.out + smoke.err
    assert f"to site {CLUSTERS[release]}" in smoke.out, smoke.out
    assert "COMPLETED; 4/4 ranks succeeded" in smoke.out, smoke.out
    hosts = {line.split('"host": "')[1].split('"')[0] for line in smoke.out.splitlines() if '"host": "' in line}
    assert hosts == set(NODES[release]), smoke.out


def test_site_init_then_check(release: str, alice: Member) -> None:
    made = alice.hpcdist("site", "init")
    assert made.code == 0, made.err
    written = alice.folder / ".config" / "hpcdist" / "sites" / f"{CLUSTERS[release]}.yaml"
    assert f"(Slurm {release}." in written.read_text(), written.read_text()[:400]
    checked = alice.hpcdist("site", "check", CLUSTERS[release])
    assert checked.code == 0, checked.out + checked.err
    assert "WRONG" not in checked.out and "partitions.main " in checked.out, checked.out

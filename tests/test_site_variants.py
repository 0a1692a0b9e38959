"""Issue 55, item 4: on Slurm clusters configured otherwise than ours (cluster/variants.sh: other
partition names and limits, typed GPU GRES on one node only under enforced accounts and a QOS
with a MaxWall, MpiDefault=pmix, no accounting at all), an ordinary member (alice) with nothing
written by hand: ``hpcdist site init`` then ``site check`` pass; a submitit user's script runs on
the compute nodes through hpcdist; ``hpcdist submit jobs/smoke.yaml`` and a 2-node train_gpt
complete; and what the cluster cannot give is one line before sbatch."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import REPO, run_cli
from tests.support.members import NO_SITE_LINE, Member, member_in, require_members
from tests.support.train import TINY, write_corpus
from tests.support.variants import require_variant, variant_env

pytestmark = [pytest.mark.slurm, pytest.mark.other_clusters]  # a group beside the main cluster's

NODES = {"parts": ("p1", "p2"), "gpus": ("g1", "g2"), "noacct": ("q1", "q2")}
DEFAULT = {"parts": "batch", "gpus": "gpu", "noacct": "debug"}
SCRIPT = """\
import os, sys
import hpcdist

ex = hpcdist.AutoExecutor("log_%j")
ex.update_parameters(timeout_min=5, slurm_partition=sys.argv[1])
job = ex.submit(lambda: os.environ["SLURMD_NODENAME"])
jobs = ex.map_array(lambda x: 2 * x, [1, 2])
print("node", job.result())
print("array", [j.result() for j in jobs])
"""


@pytest.fixture
def tokens() -> Iterator[Path]:
    folder = Path(f"/var/tmp/hpcdist-shared/t-variant-data-{uuid.uuid4().hex[:8]}")
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    try:
        corpus = write_corpus(folder / "corpus.txt", words=3000)
        made = run_cli("data", "prepare", str(corpus), "-o", str(folder / "tokens.h5"))
        assert made.code == 0, made.text
        (folder / "tokens.h5").chmod(0o644)
        yield folder / "tokens.h5"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def on(variant: str) -> Iterator[Member]:
    require_members()  # not require_slurm: the main cluster's nodes may be down for a node-fault test beside
    require_variant(variant)
    folder = Path(f"/home/alice/t-{variant}-{uuid.uuid4().hex[:8]}")
    try:
        yield member_in(folder, {"nodes.py": SCRIPT}, **variant_env(variant))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=sorted(NODES))
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def alice(variant: str) -> Iterator[Member]:
    yield from on(variant)


def test_nothing_written_by_hand_init_check_submitit_smoke_and_train(variant: str, alice: Member,
                                                                     tokens: Path) -> None:
    made = alice.hpcdist("site", "init", *(["--probe"] if variant == "parts" else []))
    assert made.code == 0, made.err
    if variant == "parts":  # what only a node knows, from one short step on it
        assert "# node-local scratch (--probe): /tmp" in (alice.folder / ".config/hpcdist/sites/parts.yaml").read_text()
    checked = alice.hpcdist("site", "check", variant)
    assert checked.code == 0, checked.out + checked.err
    assert "WRONG" not in checked.out and "see them" in checked.out, checked.out

    ran = alice.python("nodes.py", DEFAULT[variant])  # submitit's calls, no site named
    assert ran.code == 0, ran.err
    assert NO_SITE_LINE in ran.err and "Traceback" not in ran.err
    assert ran.out.split("node ")[1].split()[0] in NODES[variant], ran.out
    assert "array [2, 4]" in ran.out

    smoke = alice.hpcdist("submit", "--wait", "smoke.yaml")
    assert smoke.code == 0, smoke.err
    train = alice.hpcdist("submit", "--wait", str(REPO / "jobs" / "train_gpt.yaml"), "--set", "resources.nodes=2",
                          "--set", "resources.tasks_per_node=1", "--set", f"params.data={tokens}", *TINY,
                          "--set", "params.steps=40", "--set", "params.optim.warmup_steps=5",
                          "--set", "params.eval.every=20", "--set", "params.checkpoint.every=20", timeout=400)
    assert train.code == 0, train.out[-2000:] + train.err[-2000:]
    assert "COMPLETED" in train.out + train.err


@pytest.fixture
def on_gpus() -> Iterator[Member]:
    yield from on("gpus")


def test_typed_gres_on_some_nodes_and_the_qos_limit(on_gpus: Member) -> None:
    alice = on_gpus
    shown = alice.hpcdist("sites", "--show", "slurm")
    assert "gpu_type: a100" in shown.out and "gpu_nodes: 1" in shown.out, shown.out
    assert "account: proj-b" in shown.out and "qos_max_time_min: 20" in shown.out, shown.out
    gpus = ("--set", "resources.gpus_per_node=2", "--set", "resources.tasks_per_node=2")
    script = alice.hpcdist("render", "smoke.yaml", *gpus)
    assert "#SBATCH --gpus-per-node=a100:2" in script.out, script.out  # as the cluster names its GPUs
    ran = alice.hpcdist("submit", "--wait", "smoke.yaml", *gpus)
    # Slurm gave it g1's two, the one node with them; the GPUs are GRES only, which the bootstrap says
    assert "on g1 CUDA_VISIBLE_DEVICES='0,1' is set but torch sees no usable GPU" in ran.out, ran.out + ran.err
    two = alice.hpcdist("submit", "smoke.yaml", *gpus, "--set", "resources.nodes=2")
    assert two.code == 2 and errors(two.err) == 1, two.err
    assert "resources.nodes: 2 is not possible" in two.err and "at most 1 with GPUs on partition 'gpu'" in two.err
    long = alice.hpcdist("submit", "smoke.yaml", "--set", "resources.time_min=30")
    assert long.code == 2 and errors(long.err) == 1, long.err
    assert "at most 20 min under QOS 'v-short'" in long.err  # not a job pending for ever

    # an account that is not hers (proj-a), written into her site: named by the check, and at submit by sbatch
    assert alice.hpcdist("site", "init", "mine").code == 0
    path = alice.folder / ".config" / "hpcdist" / "sites" / "mine.yaml"
    path.write_text(path.read_text().replace("account: proj-b", "account: proj-a"))
    wrong = alice.hpcdist("site", "check", "mine", "--no-storage")
    assert wrong.code == 1 and "hpcdist: wrong: mine: account/qos: the site says account proj-a" in wrong.err, wrong.err
    refused = alice.hpcdist("submit", "--site", "mine", "smoke.yaml")
    assert refused.code == 2 and errors(refused.err) == 1, refused.err
    assert "Invalid account" in refused.err and "hpcdist site check mine" in refused.err, refused.err


def errors(err: str) -> int:
    """How many error lines hpcdist printed (its notes aside), with no traceback."""
    assert "Traceback" not in err, err
    return sum(line.startswith("hpcdist: error:") for line in err.splitlines())

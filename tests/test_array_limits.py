"""Sweeps that fit the site's limits (issue 67, item 3), on the variant cluster gpus
(cluster/variants.sh: MaxArraySize=5 in its slurm.conf, and QOS v-sweep with
MaxSubmitJobsPerUser=3, which alice may ask for), as alice with no site written, through
``hpcdist.Executor.map_array``: an array larger than MaxArraySize goes in as arrays that fit, and
one larger than the QOS takes has the rest held back and submitted as earlier ones end, each with
one line saying so, where sbatch alone refuses the whole array. Every task runs once, in order."""

from __future__ import annotations

import ast
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.members import Member, member_in, require_members
from tests.support.variants import require_variant, variant_env

pytestmark = [pytest.mark.slurm, pytest.mark.other_clusters]  # the gpus variant only

SWEEP = """\
import sys
import hpcdist

ex = hpcdist.AutoExecutor("log_%j", timeout_min=5)
if sys.argv[1] != "-":
    ex.update_parameters(slurm_additional_parameters={"qos": sys.argv[1]})
jobs = ex.map_array(lambda x: x * x, range(int(sys.argv[2])))
print("arrays", sorted({j.job_id.split("_")[0] for j in jobs}, key=int))
print("tasks", [j.job_id.split("_")[1] for j in jobs])
print("results", [j.result() for j in jobs])
"""


@pytest.fixture
def alice() -> Iterator[Member]:
    require_members()
    require_variant("gpus")
    folder = Path(f"/home/alice/t-arrays-{uuid.uuid4().hex[:8]}")
    try:
        yield member_in(folder, {"sweep.py": SWEEP}, **variant_env("gpus"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def said(out: str, key: str) -> list[object]:
    line = next(line for line in out.splitlines() if line.startswith(f"{key} "))
    return list(ast.literal_eval(line.removeprefix(f"{key} ")))


def lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("hpcdist: job array")]


def test_an_array_over_max_array_size_goes_in_as_arrays_that_fit(alice: Member) -> None:
    refused = alice.python("-c", "import subprocess, sys; sys.exit(subprocess.run(['sbatch', '--array=0-6', "
                                 "'--wrap=true', '-o', '/dev/null', '--test-only']).returncode)")
    assert refused.code != 0 and "Invalid job array specification" in refused.err, refused.err  # Slurm alone
    ran = alice.python("sweep.py", "-", "7")
    assert ran.code == 0, ran.err
    assert said(ran.out, "results") == [x * x for x in range(7)]
    arrays, tasks = said(ran.out, "arrays"), said(ran.out, "tasks")
    assert len(arrays) == 2 and tasks == ["0", "1", "2", "3", "4", "0", "1"], ran.out  # 5 + 2, each from 0
    assert [re.sub(r"'[^']+'", "NAME", line) for line in lines(ran.err)] == [
        "hpcdist: job array NAME of 7 tasks goes in as 2 arrays of at most 5 tasks: the cluster's MaxArraySize=5 "
        "(scontrol show config)"], ran.err


def test_a_qos_max_submit_jobs_holds_the_rest_back_until_earlier_ones_end(alice: Member) -> None:
    ran = alice.python("sweep.py", "v-sweep", "5")
    assert ran.code == 0, ran.err
    assert said(ran.out, "results") == [x * x for x in range(5)]
    arrays, tasks = said(ran.out, "arrays"), said(ran.out, "tasks")
    assert len(arrays) >= 2 and len(tasks) == 5, ran.out
    held = lines(ran.err)
    assert re.fullmatch(r"hpcdist: job array '[^']+': 2 of its 5 tasks held back: QOS 'v-sweep' has "
                        r"MaxSubmitJobsPerUser=3 and 3 of her jobs are queued or running under it; they are "
                        r"submitted as earlier ones end", held[0]), ran.err
    assert held[1:] and all(re.fullmatch(r"hpcdist: job array '[^']+': tasks \d-\d submitted as job array \d+", line)
                            for line in held[1:]), ran.err

"""CPUs per rank follow the node: a GPU job's ranks get their GPUs' share of the node's CPUs, on
the #SBATCH line, on srun's line and in OMP_NUM_THREADS; a CPU job keeps one; an explicit
``resources.cpus_per_task`` wins; what the partition cannot give is refused before submission."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcdist.config import load_site, read_spec
from hpcdist.config.spec import JobSpec
from hpcdist.errors import ConfigError
from hpcdist.kinds.registry import load_job
from hpcdist.login.plan import Origin
from hpcdist.login.render import render
from tests.support.cli import REPO, run_cli, storage_sets

GPU8 = ["resources.gpus_per_node=8", "resources.tasks_per_node=8"]  # a whole ndr-h100 node


def script(site_name: str, sets: list[str], job: str = "jobs/smoke.yaml") -> str:
    site = load_site(site_name, [s.removeprefix("site.") for s in sets if s.startswith("site.")])
    spec = load_job(REPO / job, site, [s for s in sets if not s.startswith("site.")]).spec
    return render(spec, site, Origin(job, site_name, tuple(sets)))


def cpus_lines(text: str) -> tuple[str, str]:
    """(the #SBATCH --cpus-per-task line, srun's --cpus-per-task option or '' when it has none)."""
    sbatch = next(ln for ln in text.splitlines() if ln.startswith("#SBATCH --cpus-per-task="))
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    return sbatch, next((w for w in srun.split() if w.startswith("--cpus-per-task=")), "")


def exported(text: str, name: str) -> str | None:
    return next((ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith(f"export {name}=")), None)


def test_a_whole_gpu_node_is_shared_out_among_its_ranks() -> None:
    """ndr-h100: 112 CPUs, 8 GPUs, 8 ranks: 14 CPUs each, bound by srun (--cpu-bind=cores)."""
    text = script("ndr-h100", GPU8)
    assert cpus_lines(text) == ("#SBATCH --cpus-per-task=14", "--cpus-per-task=14")
    assert exported(text, "OMP_NUM_THREADS") == "12"  # the site's own choice stands


def test_part_of_a_gpu_node_takes_its_gpus_share() -> None:
    """Two of the node's 8 GPUs: 14 CPUs per rank, not 56, so the other 6 GPUs keep their CPUs."""
    text = script("ndr-h100", ["resources.gpus_per_node=2", "resources.tasks_per_node=2"])
    assert cpus_lines(text) == ("#SBATCH --cpus-per-task=14", "--cpus-per-task=14")


def test_cpus_the_site_reserves_are_not_given_to_ranks() -> None:
    text = script("ndr-h100", [*GPU8, "site.partitions.gpu.reserved_cpus_per_node=16"])
    assert cpus_lines(text) == ("#SBATCH --cpus-per-task=12", "--cpus-per-task=12")  # (112 - 16) / 8


def test_torchrun_gets_the_nodes_ranks_cpus() -> None:
    text = script("hdr-a100", ["resources.gpus_per_node=4", "resources.tasks_per_node=4",
                               "site.launcher.kind=torchrun", "site.launcher.args=[]"])
    assert cpus_lines(text) == ("#SBATCH --cpus-per-task=12", "--cpus-per-task=48")  # one agent, 4 ranks x 12


def test_a_cpu_job_keeps_one_cpu_per_rank() -> None:
    text = script("ndr-h100", ["resources.tasks_per_node=8"])
    assert cpus_lines(text) == ("#SBATCH --cpus-per-task=1", "")
    for name in ("train_gpt", "demo_train", "finetune_gpt"):  # shipped specs no longer pin 1
        spec = read_spec(REPO / "jobs" / f"{name}.yaml", ["resources.gpus_per_node=2"])
        assert spec.resources.cpus_per_task is None and spec.cpus_per_task(load_site("ndr-h100")) == 14


def test_an_explicit_cpus_per_task_wins() -> None:
    text = script("ndr-h100", [*GPU8, "resources.cpus_per_task=6"])
    assert cpus_lines(text) == ("#SBATCH --cpus-per-task=6", "--cpus-per-task=6")
    text = script("ndr-h100", ["resources.tasks_per_node=4", "resources.cpus_per_task=28"])  # a CPU job
    assert cpus_lines(text) == ("#SBATCH --cpus-per-task=28", "--cpus-per-task=28")


@pytest.mark.parametrize(
    ("sets", "threads"),
    [
        ([], "12"),  # the site's env sets it
        (["env.OMP_NUM_THREADS=7"], "7"),  # the job's env sets it
        (["site.env={NCCL_DEBUG: WARN}"], "14"),  # neither: cpus_per_task
        (["site.env={}", "resources.cpus_per_task=3"], "3"),
    ],
)
def test_omp_num_threads(sets: list[str], threads: str) -> None:
    assert exported(script("ndr-h100", [*GPU8, *sets]), "OMP_NUM_THREADS") == threads


def test_omp_num_threads_from_the_shell_is_left_to_the_shell() -> None:
    text = script("ndr-h100", [*GPU8, "site.env={}", "env_passthrough=[OMP_NUM_THREADS]"])
    assert exported(text, "OMP_NUM_THREADS") is None
    assert "#SBATCH --export=ALL,OMP_NUM_THREADS" in text


def test_a_local_gpu_job_keeps_the_sites_threads_and_this_machines_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    site = load_site("local", ["partitions.local.gpus_per_node=2"])
    spec = JobSpec(name="j", kind="smoke", resources={"gpus_per_node": 2, "tasks_per_node": 2})
    assert spec.rank_env(site)["OMP_NUM_THREADS"] == "1"  # local.yaml's
    monkeypatch.setattr("hpcdist.scheduler.local_jobs.machine_cpus", lambda: 8)  # not the partition's 256
    assert spec.cpus_per_task(site) == 4
    assert spec.rank_env(site.model_copy(update={"env": {}}))["OMP_NUM_THREADS"] == "4"


def test_more_cpus_than_the_node_has_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        script("ndr-h100", [*GPU8, "resources.cpus_per_task=16"])
    assert "resources.cpus_per_task: 16 is not possible" in str(err.value)
    assert "tasks_per_node x cpus_per_task <= 112 CPUs on partition 'gpu'" in str(err.value)


def test_a_site_that_reserves_every_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"site partitions\.gpu\.reserved_cpus_per_node: 112 .*fewer than its "
                                          r"cpus_per_node 112"):
        script("ndr-h100", [*GPU8, "site.partitions.gpu.reserved_cpus_per_node=112"])


def test_sbatch_accepts_a_gpu_jobs_cpus(slurm_storage: Path) -> None:
    """The local cluster's gpu partition: 8 CPUs and 4 GPUs per node, so 2 CPUs per rank."""
    sets = ["resources.partition=gpu", "resources.gpus_per_node=4", "resources.tasks_per_node=4"]
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", *[a for s in sets for a in ("--set", s)],
                     *storage_sets(slurm_storage))
    assert result.code == 0, result.err
    assert cpus_lines(result.out) == ("#SBATCH --cpus-per-task=2", "--cpus-per-task=2")
    proc = subprocess.run(["sbatch", "--test-only"], input=result.out, text=True, capture_output=True)
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr


def test_a_cpu_job_on_a_gpu_partition_is_told_so_in_one_line() -> None:
    """The built-in train_gpt spec (2 ranks, no GPUs asked) on the shipped ndr-h100 site, whose
    partition gpu has 8 a node: `render` says so on stderr, never in the script; asking them, nothing."""
    note = ("hpcdist: note: this job asks no GPUs on partition gpu, which has 8 a node, so its ranks get none; "
            "add --set resources.gpus_per_node=2 to give each rank one (gpus_per_node=8 with tasks_per_node=8 "
            "uses them all)")
    plain = run_cli("render", "jobs/train_gpt.yaml", "--site", "ndr-h100")
    assert plain.code == 0 and note in plain.err.splitlines(), plain.text
    assert "asks no GPUs" not in plain.out and "#SBATCH --gpus-per-node" not in plain.out
    asked = run_cli("render", "jobs/train_gpt.yaml", "--site", "ndr-h100", "--set", "resources.gpus_per_node=2")
    assert asked.code == 0 and "#SBATCH --gpus-per-node=h100:2" in asked.out and "note:" not in asked.err, asked.text

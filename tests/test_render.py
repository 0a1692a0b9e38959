"""Rendered job scripts: pinned by golden files, shell-safe, and accepted by the real sbatch.

Regenerate the golden files after an intended change with:
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_render.py
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hpcdist.config import load_site
from hpcdist.errors import RenderError
from hpcdist.kinds.registry import load_job
from hpcdist.login.plan import Origin
from hpcdist.login.render import first_command_line, render
from tests.support.cli import REPO, run_cli, storage_sets

GOLDEN = Path(__file__).parent / "golden"
PYTHON = "/opt/hpcdist/bin/python"  # pinned so golden files do not depend on the venv's path
CASES = {
    "smoke-local-slurm": ("jobs/smoke.yaml", "local-slurm", []),
    "smoke-hdr-a100": ("jobs/smoke.yaml", "hdr-a100", ["resources.nodes=2", "resources.gpus_per_node=4",
                                                       "resources.tasks_per_node=4"]),
    "smoke-ndr-h100-mpirun": ("jobs/smoke.yaml", "ndr-h100", ["site.launcher.kind=mpirun", "site.launcher.args=[]"]),
    "smoke-ndr-h100-torchrun": ("jobs/smoke.yaml", "ndr-h100", ["site.launcher.kind=torchrun",
                                                                "site.launcher.args=[]", "resources.nodes=2"]),
    # containers: rendered and checked here, Charliecloud run for real in tests/test_containers.py
    "smoke-local-slurm-charliecloud": ("jobs/smoke.yaml", "local-slurm", [
        "container.runtime=charliecloud", "container.image=/shared/images/pytorch",
        "container.mounts=[/shared/datasets]"]),
    "smoke-ndr-h100-pyxis": ("jobs/smoke.yaml", "ndr-h100", [
        "container.runtime=pyxis", "container.image=/shared/ml-research/images/pytorch-24.10-hpcdist.sqsh",
        "container.mounts=[/lustre/datasets:/data]", "resources.gpus_per_node=8", "resources.tasks_per_node=8"]),
    "smoke-hdr-a100-apptainer-torchrun": ("jobs/smoke.yaml", "hdr-a100", [
        "site.launcher.kind=torchrun", "site.launcher.args=[]", "resources.nodes=2", "resources.gpus_per_node=4",
        "resources.tasks_per_node=4", "container.runtime=apptainer",
        "container.image=/p/project/myproject/images/pytorch-24.10-hpcdist.sif"]),
}


def rendered(job: str, site_name: str, sets: list[str]) -> str:
    site_sets = [s.removeprefix("site.") for s in sets if s.startswith("site.")] + [f"python={PYTHON}"]
    site = load_site(site_name, site_sets)
    spec = load_job(REPO / job, site, [s for s in sets if not s.startswith("site.")]).spec
    text = render(spec, site, Origin(job, site_name, tuple(sets)))
    # the versions that submitted a container job are this machine's, not the golden file's
    return re.sub(r"(?m)^export HPCDIST_SUBMITTED_WITH=.*$", "export HPCDIST_SUBMITTED_WITH='(versions)'", text)


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    text = rendered(*CASES[case])
    path = GOLDEN / f"{case}.sh"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{case} changed; if intended, regenerate (see module docstring)"


@pytest.mark.parametrize("case", sorted(CASES))
def test_sbatch_lines_come_first_and_parse(case: str) -> None:
    text = rendered(*CASES[case])
    lines = text.splitlines()
    first = first_command_line(text)
    assert first > 0
    assert all(not ln.startswith("#SBATCH") for ln in lines[first:])
    assert lines[0] == "#!/bin/bash"
    assert "# Reproduce with: hpcdist submit jobs/smoke.yaml --site" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_render_prints_what_submit_submits_header() -> None:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm")
    assert result.code == 0
    assert "#SBATCH --nodes=1" in result.out and "#SBATCH --signal=USR2@60" in result.out
    assert "srun --unbuffered" in result.out and "--mpi=pmix" in result.out


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        # YAML's double-quoted escapes, as a user could write them in a file
        (['site.account="evil\\nhostname"'], "site.account"),
        (['env.FOO="a\\rb"'], "job.env.FOO"),
        (['site.modules=["gcc\\0"]'], "site.modules[0]"),
        (['site.setup=["echo hi\\e[31m"]'], "site.setup[0]"),
    ],
)
def test_control_characters_are_refused_with_key(sets: list[str], key: str) -> None:
    with pytest.raises(RenderError) as err:
        rendered("jobs/smoke.yaml", "local-slurm", sets)
    assert str(err.value).startswith(f"{key}: ") and "control character" in str(err.value)


def test_cli_refuses_newline_in_job_name() -> None:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", 'name="x\\ntouch /tmp/pwned"')
    assert result.code == 2 and "name: the job name becomes a folder" in result.err
    assert result.out == ""


def test_values_are_quoted() -> None:
    text = rendered("jobs/smoke.yaml", "local-slurm", ["site.account=my acct $(reboot)", "env.GREETING=it's; rm -rf /"])
    assert "#SBATCH --account='my acct $(reboot)'" in text
    assert "export GREETING='it'\"'\"'s; rm -rf /'" in text
    # the quoted value reads back as the original through the shell
    line = next(ln for ln in text.splitlines() if ln.startswith("export GREETING="))
    assert shlex.split(line.removeprefix("export GREETING="))[0] == "it's; rm -rf /"


def test_compiled_template_cache_changes_no_byte(tmp_path: Path) -> None:
    """The template is compiled once into the user's cache: the run that writes it, the run that
    reads it, a run over a damaged cache file and one whose cache cannot be made print one script."""
    args = ("render", "jobs/smoke.yaml", "--site", "local-slurm")
    cache = tmp_path / "cache"
    first = run_cli(*args, env={"XDG_CACHE_HOME": str(cache)})
    files = list((cache / "hpcdist" / "templates").iterdir())
    assert first.code == 0 and len(files) == 1
    assert run_cli(*args, env={"XDG_CACHE_HOME": str(cache)}).out == first.out
    files[0].write_bytes(files[0].read_bytes()[:40] + b"damaged")
    assert run_cli(*args, env={"XDG_CACHE_HOME": str(cache)}).out == first.out
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert run_cli(*args, env={"XDG_CACHE_HOME": str(blocked)}).out == first.out


def test_local_site_renders_a_plan() -> None:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local")
    assert result.code == 0 and "LocalExecutor starts 2 process(es)" in result.out
    assert "#SBATCH" not in result.out


def test_sbatch_test_only_accepts_every_shipped_spec(slurm_storage: Path) -> None:
    from hpcdist.model.checkpoint import write_checkpoint
    from hpcdist.model.gpt import GPT, GPTConfig

    # infer_gpt checks its checkpoint before rendering: give it a small one where it looks
    cfg = GPTConfig(context=128, n_layer=1, n_head=4, d_model=32)
    write_checkpoint(slurm_storage / "checkpoints" / "train_gpt", 1, GPT(cfg).state_dict(), cfg)
    # train_gpt checks its token file: make a small one
    text = slurm_storage / "corpus.txt"
    text.write_text("hpcdist renders, submits and runs distributed jobs.\n" * 200)
    tokens = slurm_storage / "tokens.h5"
    assert run_cli("data", "prepare", str(text), "-o", str(tokens)).code == 0
    extra = {"train_gpt.yaml": ["--set", f"params.data={tokens}"],  # finetune_gpt starts from the checkpoint above
             "finetune_gpt.yaml": ["--set", f"params.data={tokens}",
                                   "--set", f"params.init={slurm_storage / 'checkpoints' / 'train_gpt'}"]}
    specs = sorted((REPO / "jobs").glob("*.yaml"))
    assert len(specs) >= 8
    for spec in specs:
        result = run_cli("render", str(spec.relative_to(REPO)), "--site", "local-slurm", *storage_sets(slurm_storage),
                         *extra.get(spec.name, []))
        assert result.code == 0, result.err
        proc = subprocess.run(["sbatch", "--test-only"], input=result.out, text=True, capture_output=True)
        assert proc.returncode == 0 and "to start at" in proc.stderr, f"{spec.name}: {proc.stderr}"


def test_sbatch_test_only_accepts_gpu_request(slurm_storage: Path) -> None:
    sets = ["resources.partition=gpu", "resources.nodes=2", "resources.gpus_per_node=4", "resources.tasks_per_node=4"]
    args = [a for s in sets for a in ("--set", s)]
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", *args, *storage_sets(slurm_storage))
    assert result.code == 0 and "#SBATCH --gpus-per-node=4" in result.out
    proc = subprocess.run(["sbatch", "--test-only"], input=result.out, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_each_srun_task_gets_the_jobs_cpus() -> None:
    """srun does not inherit sbatch's --cpus-per-task (Slurm 22.05 and later): each task would get
    one CPU for its threads, NCCL's proxy and the checkpoint writers."""
    text = rendered("jobs/smoke.yaml", "hdr-a100", ["resources.nodes=2", "resources.gpus_per_node=4",
                                                    "resources.tasks_per_node=4", "resources.cpus_per_task=12"])
    assert "#SBATCH --cpus-per-task=12" in text
    step = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    assert " --cpus-per-task=12 " in step

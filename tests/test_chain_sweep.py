"""Several jobs from one `hpcdist submit`: chains (afterok, a failed link stops the rest), sweeps
(one Slurm job array, a task per combination, each with its own result and checkpoint folder),
per-job sbatch options, and relative paths in a spec read from the spec file's folder."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import h5py
import pytest

from hpcdist.config import load_site
from hpcdist.config.sweep import tasks
from hpcdist.errors import ConfigError
from hpcdist.kinds.registry import load_job
from hpcdist.polling import poll_until
from hpcdist.scheduler.slurm import read_state
from hpcdist.scheduler.states import JobState
from tests.support import train as fx
from tests.support.cli import REPO, run_cli, storage_sets
from tests.support.train import train_args

SMOKE = (REPO / "jobs" / "smoke.yaml").read_text()


def write_spec(folder: Path, name: str, extra: str = "") -> Path:
    """A smoke spec named `name` in `folder`, with `extra` YAML appended."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    text = SMOKE.replace("name: smoke", f"name: {name}")
    if extra == FAILS:
        text = text.replace("timeout_s: 60", "timeout_s: 10")
    path.write_text(text + extra)
    return path


train_root, tokens = fx.train_root, fx.tokens  # session fixtures: the token file, made once
# rank 0 exits before joining: the job fails once rank 1 gives up waiting (timeout_s, 10 s, not smoke's 60)
FAILS = "env: {HPCDIST_FAULT_EXIT_RANK: '0'}\n"


def scontrol(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout


def final_states(jobs: list[str], timeout_s: float = 400) -> list[JobState]:
    """Each job's state once all have ended (other helpers' jobs may hold the nodes a while)."""
    def ended() -> list[JobState] | None:
        states = [read_state(j).state for j in jobs]
        return states if all(s.final for s in states) else None

    states = poll_until(ended, timeout_s, 2.0)
    assert states is not None, f"jobs {jobs} did not end within {timeout_s} s: {[read_state(j).state for j in jobs]}"
    return states


# ---- sweeps: the combinations, without a cluster

def test_sweep_is_the_cartesian_product_with_a_name_per_task() -> None:
    got = tasks(["params.optim.lr=1e-3,3e-3", "params.seed=1,2"])
    assert [t.overrides for t in got] == [
        ("params.optim.lr=1e-3", "params.seed=1"), ("params.optim.lr=1e-3", "params.seed=2"),
        ("params.optim.lr=3e-3", "params.seed=1"), ("params.optim.lr=3e-3", "params.seed=2"),
    ]
    assert [t.suffix for t in got] == ["-lr1e-3-seed1", "-lr1e-3-seed2", "-lr3e-3-seed1", "-lr3e-3-seed2"]
    assert [t.overrides for t in tasks(["params.paths=[torch,mpi],[torch]"])] == [
        ("params.paths=[torch,mpi]",), ("params.paths=[torch]",)]


@pytest.mark.parametrize(("sweep", "message"), [
    ("resources.nodes=1,2", "only params.* keys can vary"),
    ("params.seed", "expected KEY=V1,V2"),
    ("params.seed=1,,2", "expected KEY=V1,V2"),
])
def test_bad_sweep_is_one_clear_error(sweep: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tasks([sweep])


def test_sweep_values_are_checked_like_set_values(tmp_path: Path) -> None:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--sweep", "params.mpi=true,maybe",
                     *storage_sets(tmp_path))
    assert result.code == 2 and "params.mpi: Input should be a valid boolean" in result.err, result.text


def test_render_of_a_sweep_is_the_array_script(tmp_path: Path) -> None:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--sweep", "params.label=a,b,c",
                     "--max-parallel", "2", *storage_sets(tmp_path))
    assert result.code == 0, result.text
    assert "#SBATCH --array=0-2%2\n" in result.out
    logs = tmp_path / "logs"
    assert f"#SBATCH --output={logs}/smoke/%A_%a/%A_%a_0_log.out\n" in result.out
    assert f"--output {logs}/smoke/%A_%a/%A_%a_%t_log.out" in result.out
    assert f"hpcdist.runtime.task_runner {logs}/smoke/%j\n" in result.out  # submitit names a task's folder ID_INDEX
    assert "--sweep params.label=a,b,c --max-parallel 2" in result.out  # the reproduce line


# ---- sbatch options in the job spec

def test_sbatch_options_are_rendered_bare_flags_as_flags(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "opts", "sbatch: {exclusive: true, mail_type: END, constraint: a100, hold: false}\n")
    result = run_cli("render", str(spec), "--site", "local-slurm", *storage_sets(tmp_path))
    assert result.code == 0, result.text
    lines = [ln for ln in result.out.splitlines() if ln.startswith("#SBATCH")]
    assert lines[-3:] == ["#SBATCH --constraint=a100", "#SBATCH --exclusive", "#SBATCH --mail-type=END"]
    assert "--hold" not in result.out  # false leaves the flag out


@pytest.mark.parametrize(("options", "message"), [
    ("{exclusiv: true}", r"sbatch: 'exclusiv' is not an sbatch option; did you mean 'exclusive'\?"),
    ("{mail_typo: END}", r"sbatch: 'mail_typo' is not an sbatch option; did you mean 'mail_type'\?"),
    ("{time: 30}", r"sbatch: 'time' is set by hpcdist; set resources.time_min instead"),
    ("{array: 0-3}", r"sbatch: 'array' is set by hpcdist; set `hpcdist submit --sweep` instead"),
])
def test_bad_sbatch_option_is_one_line_naming_it(tmp_path: Path, options: str, message: str) -> None:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", f"sbatch={options}")
    assert result.code == 2 and result.err.count("\n") == 1, result.text
    assert re.search(message, result.err), result.err


def test_render_after_a_job_waits_for_it_and_dies_with_it(tmp_path: Path) -> None:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--after", "1234", *storage_sets(tmp_path))
    assert result.code == 0, result.text
    assert "#SBATCH --dependency=afterok:1234\n#SBATCH --kill-on-invalid-dep=yes\n" in result.out


# ---- relative paths

def test_relative_paths_resolve_against_the_spec_folder(tmp_path: Path) -> None:
    """The shipped inference spec copied elsewhere reads prompts.txt next to it, from any folder;
    a relative path given with --set is read from the current folder."""
    folder = tmp_path / "elsewhere" / "jobs"
    folder.mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "infer_gpt.yaml", folder)
    (folder / "prompts.txt").write_text("Hello\n")
    site = load_site("local", [s.removeprefix("site.") for s in storage_sets(tmp_path)[1::2]])
    warnings: list[str] = []
    job = load_job(folder / "infer_gpt.yaml", site, on_missing=warnings.append)
    assert job.params.prompts == str(folder / "prompts.txt")
    assert job.params.checkpoint == "train_gpt"  # a name under the site's storage.checkpoints, kept
    assert [w.split(": ")[1] for w in warnings] == ["params.checkpoint"]  # no training yet: only warned
    result = run_cli("render", str(folder / "infer_gpt.yaml"), "--site", "local-slurm", *storage_sets(tmp_path),
                     "--set", "params.prompts=mine.txt", cwd=tmp_path)
    assert result.code == 0, result.text
    assert f"params.prompts: '{tmp_path / 'mine.txt'}' does not exist here" in result.err


# ---- chains and sweeps on the local site

def test_local_chain_runs_in_order_and_stops_at_the_first_failure(tmp_path: Path) -> None:
    specs = tmp_path / "specs"
    chain = [write_spec(specs, "first"), write_spec(specs, "second", FAILS), write_spec(specs, "third")]
    result = run_cli("submit", *map(str, chain), "--chain", "--site", "local", *storage_sets(tmp_path / "out"))
    assert result.code == 1, result.text
    assert "chain 1/3: submitted job" in result.out and "chain 2/3: submitted job" in result.out
    assert "chain 3/3" not in result.out
    assert re.search(r"chain stopped at job \S+ \(second\): not run: third", result.out), result.out
    assert len(list((tmp_path / "out" / "results" / "first").glob("*.h5"))) == 1
    assert not (tmp_path / "out" / "results" / "third").exists()


def test_several_specs_need_chain(tmp_path: Path) -> None:
    result = run_cli("submit", "jobs/smoke.yaml", "jobs/smoke.yaml", "--site", "local", *storage_sets(tmp_path))
    assert result.code == 2 and "several job specs run one after another with --chain" in result.err, result.text


def test_local_sweep_runs_each_task_with_its_own_result(tmp_path: Path) -> None:
    result = run_cli("submit", "jobs/smoke.yaml", "--site", "local", "--sweep", "params.label=a,b",
                     *storage_sets(tmp_path))
    assert result.code == 0, result.text
    for label in "ab":
        (path,) = (tmp_path / "results" / f"smoke-label{label}").glob("*.h5")
        with h5py.File(path) as f:
            assert f.attrs["label"] == label


# ---- on the local Slurm cluster

def test_chain_on_slurm_waits_afterok_and_a_failed_link_cancels_the_rest(slurm_storage: Path) -> None:
    specs = slurm_storage / "specs"
    chain = [write_spec(specs, "link-one"), write_spec(specs, "link-two", FAILS), write_spec(specs, "link-three")]
    result = run_cli("submit", *map(str, chain), "--chain", "--site", "local-slurm", *storage_sets(slurm_storage))
    assert result.code == 0, result.text
    jobs = re.findall(r"chain \d/3: submitted job (\d+)", result.out)
    assert len(jobs) == 3, result.out
    third = scontrol(jobs[2])
    assert f"Dependency=afterok:{jobs[1]}" in third and "KillOInInvalidDependent=Yes" in third, third
    assert f"Dependency=afterok:{jobs[0]}" in scontrol(jobs[1])
    assert final_states(jobs) == [JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED]


def test_sweep_on_slurm_is_one_array_with_a_result_per_task(slurm_storage: Path) -> None:
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--sweep", "params.mpi=false,true",
        "--sweep", "params.label=a,b", "--max-parallel", "2", "--set", "sbatch={comment: hpcdist-sweep-test}",
        *storage_sets(slurm_storage),
    )
    assert result.code == 0, result.text
    match = re.search(r"submitted job array (\d+) \(smoke, kind smoke, 4 tasks, at most 2 at a time\)", result.out)
    assert match, result.out
    array = match.group(1)
    shown = scontrol(f"{array}_0")
    assert "Comment=hpcdist-sweep-test" in shown, shown  # the job's sbatch option reached Slurm
    jobs = [f"{array}_{i}" for i in range(4)]
    assert final_states(jobs) == [JobState.COMPLETED] * 4
    names = ["smoke-mpifalse-labela", "smoke-mpifalse-labelb", "smoke-mpitrue-labela", "smoke-mpitrue-labelb"]
    for job, name in zip(jobs, names, strict=True):
        assert f"task {job}: {name}  result: {slurm_storage / 'results' / name / job}.h5" in result.out
        with h5py.File(slurm_storage / "results" / name / f"{job}.h5") as f:
            assert (f.attrs["label"], int(f.attrs["mpi_sum"])) == (name[-1], 1 if "mpitrue" in name else -1)


def test_training_sweep_has_a_checkpoint_folder_per_task_and_compares(tokens: Path, tmp_path: Path) -> None:
    """Two learning rates: two runs with their own checkpoints (their claims never meet) and
    results, which `report --compare` shows side by side."""
    short = ["--set", "params.steps=40", "--set", "params.checkpoint.every=20", "--set", "params.eval.every=20",
             "--set", "params.optim.warmup_steps=4"]
    result = run_cli(*train_args(tmp_path, tokens, *short, "--sweep", "params.optim.lr=1e-3,3e-2"), timeout=400)
    assert result.code == 0, result.text
    names = ["train_gpt-lr1e-3", "train_gpt-lr3e-2"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == names
    for name in names:
        assert (tmp_path / "checkpoints" / name / "latest").read_text().strip().endswith("40.h5")
    results = [str(next((tmp_path / "results" / name).glob("*.h5"))) for name in names]
    shown = run_cli("report", results[0], "--compare", results[1])
    assert shown.code == 0, shown.text
    rows = {line.split()[0] + (" " + line.split()[1] if line.split()[1] in ("loss", "val") else ""): line.split()
            for line in shown.out.splitlines() if line.strip() and not line.startswith("#")}
    assert rows["params.optim.lr"][1:] == ["1e-3", "3e-2"], shown.out  # as given (a YAML string; parsed as a float)
    assert "steps done" in shown.out and "40/40" in shown.out
    losses = [float(v) for v in rows["final loss"][2:]]
    assert len(losses) == 2 and losses[0] != losses[1], shown.out

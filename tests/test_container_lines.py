"""Jobs in containers, without running one: each runtime's words against its documented form, the
refusals at submit (one line, nothing queued), the versions a rank compares, and the requeue the
batch step carries out for ranks inside an image; then one rootless podman run on the cluster, as
alice, whose ranks see the job's variables, not the image's. Charliecloud runs for real in
tests/test_containers.py; Apptainer and pyxis are not installable here (no Debian package)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from hpcdist.config import load_site
from hpcdist.config.container import fold_onto_image
from hpcdist.config.spec import plan_for
from hpcdist.containers import Bind, ContainerPlan, get_runtime
from hpcdist.errors import ConfigError
from hpcdist.kinds.registry import load_job
from hpcdist.login.plan import Origin
from hpcdist.login.render import render
from hpcdist.runtime import requeue
from hpcdist.runtime.task_runner import version_mismatch
from tests.support.cli import REPO, job_id, missing, run_cli, storage_sets
from tests.support.members import as_user, require_members, run_as

PLAN = ContainerPlan("x", "/images/pt", "python3", (Bind("/scratch", "/scratch"), Bind("/lustre/data", "/data")),
                     ("--extra",), gpus=True, names=("HPCDIST_CONTAINER", "NCCL_DEBUG"), task_names=("SLURM_PROCID",),
                     home="/scratch/job/home")


def words(runtime: str, **kw: object) -> list[str]:
    plan = ContainerPlan(**{**PLAN.__dict__, "runtime": runtime, **kw})  # type: ignore[arg-type]
    rt = get_runtime(runtime)
    return shlex.split(" ".join([*rt.srun_flags(plan), *rt.wrap(plan)]))


def test_each_runtime_in_its_documented_form() -> None:
    # env(1), the last words before the image's Python
    inside = ["env", "-u", "PYTHONPATH", "PYTHONNOUSERSITE=1", "HOME=/scratch/job/home"]
    # ch-run(1): ch-run [OPTION...] IMAGE -- CMD; -b, --bind=SRC[:DST]
    assert words("charliecloud", home=None) == ["ch-run", "--bind=/scratch:/scratch", "--bind=/lustre/data:/data",
                                                "--extra", "/images/pt", "--", *inside[:4]]
    # apptainer exec [exec options...] <container> <command>; --nv; --no-home; --bind src[:dest][,src[:dest]...]
    assert words("apptainer") == ["apptainer", "exec", "--nv", "--no-home", "--bind",
                                  "/scratch:/scratch,/lustre/data:/data", "--extra", "/images/pt", *inside]
    assert "--nv" not in words("apptainer", gpus=False)
    # pyxis: srun --container-image=PATH --container-mounts=SRC:DST[,...] --container-workdir=PATH
    # --container-env=NAME[,NAME...]; the rank's start unsets enroot's 50-slurm-pytorch.sh variables
    assert words("pyxis", image="/images/pt.sqsh") == [
        "--container-image=/images/pt.sqsh",
        "--container-mounts=/scratch:/scratch,/lustre/data:/data,$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR",
        "--container-workdir=$SLURM_SUBMIT_DIR", "--no-container-mount-home",
        "--container-env=HPCDIST_CONTAINER,NCCL_DEBUG,SLURM_PROCID", "--extra", "env", "-u", "RANK", "-u", "WORLD_SIZE",
        "-u", "LOCAL_RANK", "-u", "MASTER_ADDR", "-u", "MASTER_PORT", *inside[1:]]
    # podman run [options] image [command]; --env NAME (the host's value), --env 'PREFIX*'; -v SRC:DST; CDI
    assert words("podman", infiniband=True) == [
        "podman", "run", "--rm", "--network=host", "--ipc=host", "--userns=keep-id", "--env", "SLURM_*", "--env",
        "PMIX_*", "--env", "HPCDIST_CONTAINER", "--env", "NCCL_DEBUG", "--env", "SLURM_PROCID", "--device",
        "nvidia.com/gpu=all", "--device", "/dev/infiniband", "--ulimit=host", "-v", "/scratch:/scratch", "-v",
        "/lustre/data:/data", "-v", "$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR", "--workdir=$SLURM_SUBMIT_DIR", "--extra",
        "/images/pt", *inside]
    assert "--env-host" not in words("podman")  # it would put the host's PATH and LD_LIBRARY_PATH over the image's


def rendered(*sets: str, site: str = "ndr-h100", gpus: bool = True) -> str:
    """`hpcdist render` of the smoke job, as a user types it (a whole GPU node when `gpus`)."""
    n = 4 if site == "hdr-a100" else 8
    res = ["--set", f"resources.gpus_per_node={n}", "--set", f"resources.tasks_per_node={n}"] if gpus else []
    result = run_cli("render", "jobs/smoke.yaml", "--site", site, *res, *(a for s in sets for a in ("--set", s)))
    assert result.code == 0, result.text
    return result.out


def launch(script: str) -> list[str]:
    return shlex.split(next(ln for ln in script.splitlines() if ln.startswith("srun --unbuffered")))


def flag(line: list[str], name: str) -> str:
    return next(w.split("=", 1)[1] for w in line if w.startswith(f"{name}="))


@pytest.fixture
def sqsh(tmp_path: Path) -> tuple[str, str]:
    """A pyxis job's container keys, its image a file (submit and render check it is there)."""
    (tmp_path / "pt-hpcdist.sqsh").write_bytes(b"hsqs")
    return "container.runtime=pyxis", f"container.image={tmp_path / 'pt-hpcdist.sqsh'}"


def test_pyxis_line_forces_the_jobs_names_over_the_images_and_starts_in_the_submit_directory(
        sqsh: tuple[str, str]) -> None:
    script = rendered(*sqsh, "env.NCCL_DEBUG=INFO", "env_passthrough=[WANDB_API_KEY]")
    line = launch(script)
    forced = flag(line, "--container-env").split(",")
    # the job's, the site's (NCCL_*, UCX_*, OMP_NUM_THREADS), the pass-through name (its value is never written),
    # hpcdist's, and srun's per-task table (hpcdist.launchers): every one the ranks read
    for name in ("NCCL_DEBUG", "NCCL_IB_HCA", "UCX_NET_DEVICES", "OMP_NUM_THREADS", "WANDB_API_KEY",
                 "HPCDIST_CONTAINER", "HPCDIST_SUBMITTED_WITH", "SUBMITIT_PREEMPTION_SIGNAL", "PMIX_RANK",
                 "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_ID"):
        assert name in forced, name
    start = line[line.index("--mpi=pmix") + 1:]  # after srun's own options: the rank's start inside the image
    assert start[:11] == ["env", "-u", "RANK", "-u", "WORLD_SIZE", "-u", "LOCAL_RANK", "-u", "MASTER_ADDR", "-u",
                          "MASTER_PORT"]  # enroot's 50-slurm-pytorch.sh would make them pick the env:// table
    assert start[11:16] == ["-u", "PYTHONPATH", "PYTHONNOUSERSITE=1", "HOME=/scratch/ml-research/hpcdist/smoke/home",
                            "python3"]
    assert "mkdir -p -m 700 /scratch/ml-research/hpcdist/smoke/home" in script  # made before the launch, writable
    assert flag(line, "--container-workdir") == "$SLURM_SUBMIT_DIR"  # not the image's /workspace
    mounts = flag(line, "--container-mounts").split(",")
    assert "$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR" in mounts and "/tmp:/tmp" in mounts  # pyxis chdirs there; PMIx
    assert 'export NVIDIA_VISIBLE_DEVICES="${NVIDIA_VISIBLE_DEVICES:-all}" NVIDIA_DRIVER_CAPABILITIES=' \
           '"${NVIDIA_DRIVER_CAPABILITIES:-compute,utility}"' in script  # enroot's 98-nvidia.sh acts on them
    assert "NVIDIA_VISIBLE_DEVICES" not in rendered(*sqsh, gpus=False)  # a CPU job asks for no driver
    assert "nvcr.io" not in script


def test_a_site_that_sets_pythonpath_keeps_it(sqsh: tuple[str, str]) -> None:
    line = launch(rendered(*sqsh, "site.env.PYTHONPATH=/shared/ml-research/lib"))
    assert "PYTHONPATH" in flag(line, "--container-env").split(",")
    assert "PYTHONPATH" not in line[line.index("env"):]


def test_apptainer_exports_the_jobs_values_over_the_images(tmp_path: Path) -> None:
    (tmp_path / "pt.sif").write_bytes(b"SIF")
    script = rendered("container.runtime=apptainer", f"container.image={tmp_path / 'pt.sif'}",
                      "env_passthrough=[HF_TOKEN]", site="hdr-a100")
    line = launch(script)
    assert line[line.index("exec") + 1:line.index("exec") + 3] == ["--nv", "--no-home"]
    assert "--bind" in line and "/tmp:/tmp" in line[line.index("--bind") + 1].split(",")  # PMIx for --mpi=pmix
    loop = next(ln for ln in script.splitlines() if ln.startswith("for v in "))
    assert "NCCL_IB_HCA" in loop and "HF_TOKEN" in loop and "SLURM_PROCID" not in loop  # job-wide names only
    # run as the job script runs it: the value (commas and a second '=', which --env would split) reaches
    # APPTAINERENV_*, a variable not set stays unset, and no value is written in the script
    probe = f"export NCCL_IB_HCA='=mlx5_0,mlx5_1' NCCL_DEBUG=WARN; unset HF_TOKEN; {loop}\nenv"
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert "APPTAINERENV_NCCL_IB_HCA==mlx5_0,mlx5_1" in out and "APPTAINERENV_NCCL_DEBUG=WARN" in out
    assert not any(v.startswith("APPTAINERENV_HF_TOKEN") for v in out)


def test_podman_names_each_variable_and_brings_infiniband_and_memlock() -> None:
    line = launch(rendered("site.containers.podman={pmix_dir: /tmp}", "container.runtime=podman",
                           "container.image=localhost/pt-hpcdist:24.10"))
    named = {line[i + 1] for i, w in enumerate(line) if w == "--env"}
    assert {"SLURM_*", "PMIX_*", "NCCL_IB_HCA", "OMP_NUM_THREADS", "HPCDIST_CONTAINER"} <= named
    assert "--env-host" not in line
    assert line[line.index("/dev/infiniband") - 1] == "--device" and "--ulimit=host" in line
    assert "--workdir=$SLURM_SUBMIT_DIR" in line
    local = launch(rendered("container.runtime=podman", "container.image=localhost/x", site="local-slurm", gpus=False))
    assert "/dev/infiniband" not in local  # no HCAs on the site


@pytest.mark.parametrize(("runtime", "image"), [("pyxis", "pt.sqsh"), ("apptainer", "pt.sif")])
def test_pmix_without_its_folder_is_one_line_naming_the_site_key(runtime: str, image: str, tmp_path: Path) -> None:
    (tmp_path / image).write_bytes(b"")
    sets = ["--set", f"site.containers.{runtime}={{}}", "--set", f"container.runtime={runtime}",
            "--set", f"container.image={tmp_path / image}"]
    for command in ("render", "submit"):
        result = run_cli(command, "jobs/smoke.yaml", "--site", "ndr-h100", *sets)
        assert result.code == 2, result.text
        assert f"site containers.{runtime}.pmix_dir: None is not possible on site 'ndr-h100'" in result.err
        assert "srun --mpi=pmix" in result.err and "Traceback" not in result.err
        assert len(result.err.strip().splitlines()) == 1 and "submitted job" not in result.out
    # torchrun starts no PMIx ranks: nothing to bind
    assert run_cli("render", "jobs/smoke.yaml", "--site", "ndr-h100", *sets, "--set", "site.launcher.kind=torchrun",
                   "--set", "site.launcher.args=[]").code == 0


def spec_and_site(*sets: str, site: str = "local-slurm", job: str = "jobs/smoke.yaml"):  # type: ignore[no-untyped-def]
    site_sets = [s.removeprefix("site.") for s in sets if s.startswith("site.")]
    loaded = load_site(site, site_sets)
    return load_job(REPO / job, loaded, [s for s in sets if not s.startswith("site.")]).spec, loaded


@pytest.mark.parametrize("launcher", ["srun", "mpirun", "torchrun"])
def test_the_launcher_stays_outside_and_the_rank_runs_inside(launcher: str) -> None:
    spec, site = spec_and_site(f"site.launcher.kind={launcher}", "site.launcher.args=[]",
                               "container.runtime=charliecloud", "container.image=/images/pt",
                               "container.python=/opt/venv/bin/python")
    script = render(spec, site, Origin("jobs/smoke.yaml", "local-slurm"))
    launch = script[script.index("# ---- launch"):]
    head = {"srun": "srun ", "mpirun": "mpirun ", "torchrun": "srun "}[launcher]
    module = {"srun": "hpcdist.runtime.task_runner", "mpirun": "hpcdist.runtime.task_ids",
              "torchrun": "hpcdist.runtime.agent"}[launcher]
    line = next(ln for ln in launch.splitlines() if ln.startswith(head))
    start = line.index("/images/pt -- env -u PYTHONPATH PYTHONNOUSERSITE=1 /opt/venv/bin/python")
    assert line.index("ch-run ") < start < line.index(module)
    assert "--bind=/var/tmp/hpcdist-slurm/tmpfs:/var/tmp/hpcdist-slurm/tmpfs" in line  # PMIx's folder, the site's
    # what runs in the batch step is the node's Python, outside: the requeue the ranks ask for, the restart check
    outside = sys_python(site)
    assert f"hpcdist_requeue_asked() {{ {outside} -m hpcdist.runtime.requeue " in script
    assert f"{outside} -m hpcdist.runtime.node_failure" in script
    if launcher == "torchrun":  # the head's address and port: found outside, before the launch
        assert f"HPCDIST_RDZV_PORT=$({outside} -m hpcdist.runtime.agent --free-port)" in script
    assert 'export USER="${USER:-$(id -un)}"' in script  # ch-run 0.31 will not start without it


def sys_python(site) -> str:  # type: ignore[no-untyped-def]
    import sys

    from hpcdist.launchers import SAFE_PATH

    return " ".join([site.python or sys.executable, *SAFE_PATH])  # -P: no working folder first on its path


def test_a_site_default_container_and_a_job_opting_out() -> None:
    spec, site = spec_and_site()  # local-slurm's default runtime: no image, no container
    assert site.container is not None and plan_for(spec, site) is None
    spec, site = spec_and_site("container.image=/images/pt")  # an image is enough
    assert plan_for(spec, site).runtime == "charliecloud"  # type: ignore[union-attr]
    sets = ("site.container.runtime=charliecloud", "site.container.image=/images/pt")
    spec, site = spec_and_site(*sets)
    assert plan_for(spec, site) is not None and plan_for(spec, site).image == "/images/pt"  # type: ignore[union-attr]
    spec, site = spec_and_site(*sets, "container.image=/images/other")  # the job's keys over the site's
    assert plan_for(spec, site).image == "/images/other"  # type: ignore[union-attr]
    spec, site = spec_and_site(*sets, "container.runtime=none")
    assert plan_for(spec, site) is None and "ch-run" not in render(spec, site, Origin("jobs/smoke.yaml", "x"))


@pytest.mark.parametrize(("sets", "said"), [
    (["container.runtime=apptainer", "container.image=/images/pt"],
     "container.runtime: 'apptainer' is not possible on site 'local-slurm'; allowed: one of the site's runtimes: "
     "charliecloud, podman"),
    (["container.runtime=docker", "container.image=/x"], "unknown container runtime"),
    (["container.runtime=charliecloud"], "container.image"),
    (["container.runtime=charliecloud", "container.image=/x", "container.mounts=[data]"], "is not a mount"),
    (["site.containers.pyxis={}", "site.launcher.kind=mpirun", "site.launcher.args=[]", "container.runtime=pyxis",
      "container.image=/shared/images/pt.sqsh"], "a launcher that starts its ranks with srun"),
    (["site.containers.singularity={}"], "unknown container runtime(s) singularity"),
])
def test_a_container_the_site_cannot_run_is_one_line_at_submit(sets: list[str], said: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    result = run_cli("submit", "jobs/smoke.yaml", "--site", "local-slurm", *args)
    assert result.code == 2, result.text
    assert said in result.err and "Traceback" not in result.err and len(result.err.strip().splitlines()) <= 2
    assert "submitted job" not in result.out


def test_a_local_site_runs_no_container() -> None:
    with pytest.raises(ConfigError, match="a Slurm site"):
        spec_and_site("site.containers.charliecloud={}", "container.runtime=charliecloud", "container.image=/x",
                      site="local")


def image_dir(tmp_path: Path, *folders: str) -> Path:
    image = tmp_path / "image"
    for folder in ("usr/bin", "var/tmp", *folders):
        (image / folder).mkdir(parents=True, exist_ok=True)
    (image / "usr/bin/python3").write_text("")
    return image


def test_charliecloud_binds_land_on_the_images_empty_mount_points(tmp_path: Path) -> None:
    image = image_dir(tmp_path, "shared", "opt/data")
    plan = ContainerPlan("charliecloud", str(image), binds=(
        Bind("/shared/me/results", "/shared/me/results"), Bind("/shared/me/logs", "/shared/me/logs"),
        Bind("/opt/data/x", "/opt/data/x"), Bind("/var/tmp/a/b", "/var/tmp/a/b"), Bind("/usr/lib/x", "/usr/lib/x"),
        Bind("/src", "/nowhere")))
    folded, missing = fold_onto_image(plan)
    assert [str(b) for b in folded.binds] == ["/shared", "/opt/data", "/var/tmp"]
    # /usr/lib is not in the image, and /usr is not empty there (binding it would hide the image's /usr);
    # a bind to another path inside needs its own target
    assert missing == ["/usr/lib/x", "/nowhere"]


def test_missing_image_mount_or_mount_point_refused_at_submit(tmp_path: Path) -> None:
    base = ["--site", "local-slurm", "--set", "container.runtime=charliecloud"]
    result = run_cli("submit", "jobs/smoke.yaml", *base, "--set", f"container.image={tmp_path / 'none'}")
    assert result.code == 2 and f"container.image '{tmp_path / 'none'}' does not exist here" in result.err
    image = image_dir(tmp_path)
    result = run_cli("submit", "jobs/smoke.yaml", *base, "--set", f"container.image={image}",
                     "--set", f"container.mounts=[{tmp_path / 'gone'}]")
    assert result.code == 2 and f"{tmp_path / 'gone'} does not exist here" in result.err
    (image / "var/tmp/keep").write_text("")  # /var/tmp is not an empty mount point: nothing to bind the roots onto
    result = run_cli("submit", "jobs/smoke.yaml", *base, "--set", f"container.image={image}")
    assert result.code == 2 and "has no folder to bind /var/tmp/hpcdist-shared/results" in result.err
    assert f"mkdir -p {image}/var/tmp/hpcdist-shared/results" in result.err
    assert "Traceback" not in result.err


def test_the_images_versions_against_the_submitters() -> None:
    here = {"python": "3.12.3", "hpcdist": "0.1.0", "torch": "2.5.0a0+e000cf0"}
    error, _ = version_mismatch("python=3.11.7 hpcdist=0.1.0 torch=2.13.0", here)
    assert "the image's Python 3.12.3 cannot run this job, submitted with Python 3.11.7" in error
    error, _ = version_mismatch("python=3.12.1 hpcdist=0.0.9 torch=2.5.0a0+e000cf0", here)
    assert "the image has hpcdist 0.1.0, the job was submitted with hpcdist 0.0.9" in error
    error, warning = version_mismatch("python=3.12.1 hpcdist=0.1.0 torch=2.13.0", here)
    assert error == "" and "the image has torch 2.5.0a0+e000cf0, the submitting side torch 2.13.0" in warning
    assert version_mismatch("python=3.12.0 hpcdist=0.1.0 torch=2.5.0a0+e000cf0", here) == ("", "")


def test_a_requeue_asked_inside_is_done_by_the_batch_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    done: list[str] = []
    monkeypatch.setattr(requeue.slurm, "requeue", done.append)
    monkeypatch.setattr(requeue, "slurm_leaves_it", lambda job, restarts: "")
    env = {"SLURM_JOB_ID": "77"}
    folder = tmp_path / "77"
    folder.mkdir()
    assert requeue.main([str(tmp_path / "%j")], env) == 0 and done == []  # nothing asked: nothing done
    requeue.ask_outside(folder, "77", restarts=0)
    assert requeue.main([str(tmp_path / "%j")], env) == 0
    assert done == ["77"] and "requeueing job 77, as its ranks in the container asked" in capsys.readouterr().err
    assert not requeue.request_path(folder, "77").exists()  # once
    monkeypatch.setattr(requeue, "slurm_leaves_it", lambda job, restarts: "job 77 is ending in Slurm (CANCELLED)")
    requeue.ask_outside(folder, "77", restarts=0)
    assert requeue.main([str(tmp_path / "%j")], env) == 0 and done == ["77"]
    assert "job 77 is ending in Slurm" in capsys.readouterr().err


# ---------------------------------------------------------------- one rootless podman run, for real

IMAGE = Path(os.environ.get("HPCDIST_IMAGE", "/var/tmp/hpcdist-images/bookworm"))  # cluster/image.sh, `make image`


def podman_image(user: str) -> str:
    """The suite's Charliecloud image as `user`'s podman image (``podman import``, once per build of
    it: ~30 s), with values of its own that the job's must beat."""
    if shutil.which("podman") is None:
        missing("podman is missing: run `make system-deps` (cluster/install-deps.sh installs it)")
    if not (IMAGE / ".hpcdist-image").is_file():
        missing(f"no container image at {IMAGE}: run `make image`")
    tag = "localhost/hpcdist-bookworm:" + hashlib.sha256((IMAGE / ".hpcdist-image").read_bytes()).hexdigest()[:12]
    if run_as(user, "podman", "image", "exists", tag).code != 0:
        tar = subprocess.Popen(["tar", "-C", str(IMAGE), "-c", "."], stdout=subprocess.PIPE)
        env = ["env", "-i", f"HOME=/home/{user}", f"USER={user}", "PATH=/usr/bin:/bin"]
        own_env = ["--change", "ENV=NCCL_DEBUG=IMAGE", "--change", "ENV=PYTHONPATH=/image/site"]
        made = subprocess.run(["runuser", "-u", user, "--", *env, "podman", "import", *own_env, "-", tag],
                              stdin=tar.stdout, cwd="/", capture_output=True, text=True, timeout=180, check=False)
        tar.wait()
        assert made.returncode == 0, made.stderr
    return tag


@pytest.mark.slurm
def test_a_member_runs_ranks_in_rootless_podman_and_they_see_the_jobs_variables(tmp_path: Path) -> None:
    require_members()
    tag = podman_image("alice")
    # alice's own roots: rootless podman keeps no supplementary group (--group-add keep-groups needs
    # crun, which refuses this machine's hybrid cgroups), so the group site's 3770 roots are closed to it
    root = Path("/var/tmp/hpcdist-shared") / f"podman-{os.getpid()}"
    for key in ("results", "checkpoints", "scratch", "logs"):
        (root / key).mkdir(parents=True)
    subprocess.run(["chown", "-R", "alice:alice", str(root)], check=True)
    try:
        run = as_user("alice", "-m", "hpcdist.cli", "submit", "--site", "local-slurm", *storage_sets(root),
                      "--set", "resources.nodes=2", "--set", "sbatch.nodelist=n1,n2",
                      "--set", "container.runtime=podman", "--set", f"container.image={tag}",
                      "--set", "env.NCCL_DEBUG=JOB", "--wait", "--",
                      str(REPO / "tests" / "scripts" / "in_image.py"), env={"NCCL_DEBUG": "SHELL"})
        assert run.code == 0, run.text
        assert "finished: COMPLETED; 2/2 ranks succeeded" in run.out, run.out
        folder = root / "logs" / "in_image" / job_id(run.out)
        said = [json.loads(ln.split(" ", 1)[1]) for p in sorted(folder.glob("*_log.out"))
                for ln in p.read_text().splitlines() if ln.startswith("in_image ")]
        assert [(r["rank"], r["host"], r["runtime"], r["python"]) for r in said] == [
            (0, "n1", "podman", "/usr/bin/python3"), (1, "n2", "podman", "/usr/bin/python3")]
        home = str(root / "scratch" / "in_image" / "home")
        for r in said:  # the job's value over the image's ENV and the shell's; the image's PYTHONPATH gone
            assert r["env"] == {"NCCL_DEBUG": "JOB", "PYTHONPATH": None, "PYTHONNOUSERSITE": "1", "HOME": home}
            assert r["cwd"] == "/home/alice"  # the submit directory, not the image's /
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_charliecloud_image_keeps_its_own_path_and_library_path_and_nothing_else_of_its_env(
        tmp_path: Path) -> None:
    image = image_dir(tmp_path)
    (image / "ch").mkdir()
    (image / "ch" / "environment").write_text(  # as ch-image writes an OCI image's ENV
        "PATH=/opt/conda/bin:/usr/bin:/bin\nLD_LIBRARY_PATH=/opt/conda/lib\nNCCL_DEBUG=IMAGE\n")
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "container.runtime=charliecloud",
                     "--set", f"container.image={image}")
    assert result.code == 0, result.text
    words = launch(result.out)
    assert "--set-env=PATH=/opt/conda/bin:/usr/bin:/bin" in words
    assert "--set-env=LD_LIBRARY_PATH=/opt/conda/lib" in words
    assert not any("NCCL_DEBUG" in w for w in words)  # the job's value stays the job's
    (image / "ch" / "environment").unlink()  # an image cluster/image.sh built: the host's, as before
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "container.runtime=charliecloud",
                     "--set", f"container.image={image}")
    assert result.code == 0 and "--set-env" not in result.out


def test_a_path_with_a_comma_in_pyxis_or_apptainers_list_of_binds_is_refused_in_one_line(tmp_path: Path) -> None:
    image = tmp_path / "pt.sqsh"
    image.write_text("")
    for site, runtime in (("ndr-h100", "pyxis"), ("hdr-a100", "apptainer")):
        result = run_cli("render", "jobs/smoke.yaml", "--site", site, "--set", f"container.runtime={runtime}",
                         "--set", f"container.image={image}", "--set", "site.storage.results=/srv/a,b/results")
        assert result.code == 2 and "\n" not in result.err.strip(), result.text
        assert f"'/srv/a,b/results' has a comma, which {runtime} reads as the end of a bind" in result.err
    here = tmp_path / "runs,2024"  # pyxis binds the submit directory too
    here.mkdir()
    result = run_cli("render", str(REPO / "jobs/smoke.yaml"), "--site", "ndr-h100", "--set",
                     f"container.image={image}", cwd=here)
    assert result.code == 2 and f"'{here}' has a comma" in result.err and "submit from a path without one" in result.err

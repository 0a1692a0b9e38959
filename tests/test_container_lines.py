"""Jobs in containers, without running one: each runtime's words against its documented form, the
refusals at submit (one line, nothing queued), the versions a rank compares, and the requeue the
batch step carries out for ranks inside an image. Charliecloud runs for real in
tests/test_containers.py; Apptainer, pyxis and podman are not installable here."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpcdist.config import load_site
from hpcdist.config.container import fold_onto_image
from hpcdist.config.spec import plan_for
from hpcdist.containers import Bind, ContainerPlan, get_runtime
from hpcdist.errors import ConfigError
from hpcdist.jobs.registry import load_job
from hpcdist.login.render import Origin, render
from hpcdist.runtime import requeue
from hpcdist.runtime.submitted import version_mismatch
from tests.support.cli import REPO, run_cli

PLAN = ContainerPlan("x", "/images/pt", "python3", (Bind("/scratch", "/scratch"), Bind("/lustre/data", "/data")),
                     ("--extra",), gpus=True)


def words(runtime: str, **kw: object) -> list[str]:
    plan = ContainerPlan(**{**PLAN.__dict__, "runtime": runtime, **kw})  # type: ignore[arg-type]
    rt = get_runtime(runtime)
    return shlex.split(" ".join([*rt.srun_flags(plan), *rt.wrap(plan)]))


def test_each_runtime_in_its_documented_form() -> None:
    # ch-run(1): ch-run [OPTION...] IMAGE -- CMD; -b, --bind=SRC[:DST]
    assert words("charliecloud") == ["ch-run", "--bind=/scratch:/scratch", "--bind=/lustre/data:/data", "--extra",
                                     "/images/pt", "--"]
    # apptainer exec [exec options...] <container> <command>; --nv; --bind src[:dest][,src[:dest]...]
    assert words("apptainer") == ["apptainer", "exec", "--nv", "--bind", "/scratch:/scratch,/lustre/data:/data",
                                  "--extra", "/images/pt"]
    assert "--nv" not in words("apptainer", gpus=False)
    # pyxis: srun --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH --container-mounts=SRC:DST[:FLAGS][,...]
    assert words("pyxis", image="nvcr.io#nvidia/pytorch:24.10-py3") == [
        "--container-image=nvcr.io#nvidia/pytorch:24.10-py3", "--container-mounts=/scratch:/scratch,/lustre/data:/data",
        "--no-container-mount-home", "--extra"]
    # podman run [options] image [command]; -v SRC:DST; CDI devices
    assert words("podman") == ["podman", "run", "--rm", "--network=host", "--ipc=host", "--userns=keep-id",
                               "--env-host", "--device", "nvidia.com/gpu=all", "-v", "/scratch:/scratch", "-v",
                               "/lustre/data:/data", "--extra", "/images/pt"]


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
    module = {"srun": "hpcdist.runtime.submitted", "mpirun": "hpcdist.runtime.shim",
              "torchrun": "hpcdist.runtime.agent"}[launcher]
    line = next(ln for ln in launch.splitlines() if ln.startswith(head))
    assert line.index("ch-run ") < line.index("/images/pt -- /opt/venv/bin/python") < line.index(module)
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

    return site.python or sys.executable


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
     "charliecloud"),
    (["container.runtime=docker", "container.image=/x"], "unknown container runtime"),
    (["container.runtime=charliecloud"], "container.image"),
    (["container.runtime=charliecloud", "container.image=/x", "container.mounts=[data]"], "is not a mount"),
    (["site.containers.pyxis={}", "site.launcher.kind=mpirun", "site.launcher.args=[]", "container.runtime=pyxis",
      "container.image=nvcr.io#nvidia/pytorch:24.10-py3"], "a launcher that starts its ranks with srun"),
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

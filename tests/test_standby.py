"""A job with spares and its standby job (``hpcdist.runtime.standby``), in the parts a dead batch
node is not needed for: what is queued and with what, which ends the standby takes over, and the
chain every front door follows. Slurm's commands are scripts first on PATH here (sbatch notes its
arguments and environment; scontrol and sinfo answer as for a job whose batch node n2 died);
tests/test_in_job_restart.py kills the batch node of a real job.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpcdist.config import load_site, load_spec
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.login import standby as login_standby
from hpcdist.runtime import standby
from hpcdist.scheduler.states import JobState
from hpcdist.store.records import health, node_failures
from tests.support.cli import run_cli

SHOW = ("JobId={job} JobName=sgd UserId=alice(1000) JobState={state} Reason=None Restarts=0 BatchHost=n2 "
        "NodeList=n[2-4] NumNodes=3 ExcNodeList=(null) ReqNodeList=(null) SubmitTime=2026-11-29T04:00:00")


def fake_slurm(bin_dir: Path, state: str) -> Path:
    """sbatch (answers 778, notes its argv and SLURM_JOB_ID), scontrol (job 777 ended `state`,
    batch host n2; notes updates), sinfo (n2 down)."""
    bin_dir.mkdir()
    calls = bin_dir / "calls"
    scripts = {
        "sbatch": f'echo "sbatch $* SLURM_JOB_ID=${{SLURM_JOB_ID:-}}" >> {calls}\necho 778\n',
        "scontrol": f'echo "scontrol $*" >> {calls}\ncase "$*" in *"show job"*) echo "{SHOW}";; esac\n'.format(
            job="777", state=state),
        "sinfo": "printf 'n2|cpu*|down*|Not responding\\nn3|cpu*|mixed|none\\nn4|cpu*|mixed|none\\n'\n",
        "squeue": "exit 0\n",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    return calls


def job(root: Path) -> tuple[JobSpec, Site]:
    site = load_site("local-slurm", [f"storage.{k}={root / k}" for k in ("results", "checkpoints", "scratch", "logs")])
    spec = load_spec("jobs/smoke.yaml", site, ["resources.nodes=2", "resources.spare_nodes=1"])
    return spec, site


@pytest.fixture
def queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[JobSpec, Site, Path]:
    """Job 777's folder as submitit left it (its script and pickled call), Slurm's commands faked."""
    calls = fake_slurm(tmp_path / "bin", "NODE_FAIL")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    spec, site = job(tmp_path)
    folder = spec.paths(site, "777").folder
    folder.mkdir(parents=True)
    (folder / "777_submission.sh").write_text("#!/bin/bash\n#SBATCH --nodes=3\n")
    (folder / "777_submitted.pkl").write_bytes(b"the call")
    return spec, site, calls


def test_a_standby_is_queued_behind_the_job_with_its_own_key_and_the_jobs_call(
        queued: tuple[JobSpec, Site, Path]) -> None:
    """sbatch of the job's own script, after it fails (not after it completes), on fewer spares
    if need be, its argument the job it stands by for, in an environment without this job's Slurm
    identity; its folder holds a fresh key and the job's call and script, the user's alone."""
    spec, site, calls = queued
    assert standby.queue(spec, site, "777", {"SLURM_JOB_ID": "777", "PATH": os.environ["PATH"]}) == "778"
    said = calls.read_text()
    folder = spec.paths(site, "777").folder
    assert (f"sbatch --parsable --dependency=afternotok:777 --kill-on-invalid-dep=yes --nodes=2-3 "
            f"{folder / '777_submission.sh'} 777 SLURM_JOB_ID=") in said, said
    theirs = spec.paths(site, "778")
    assert (theirs.folder / "778_submitted.pkl").read_bytes() == b"the call"
    assert (theirs.folder / "778_submission.sh").read_text().startswith("#!/bin/bash")
    for path in (theirs.folder / "778_submitted.pkl", theirs.folder / "778_submission.sh", theirs.store_key,
                 spec.paths(site, "777").standby):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert standby.read_link(spec.paths(site, "777").standby) == "778"
    assert login_standby.chain(spec, site, "777") == ["777", "778"]


def test_a_standby_takes_over_a_job_whose_batch_node_died(queued: tuple[JobSpec, Site, Path]) -> None:
    """Job 777 ended NODE_FAIL, its batch node n2 down: the standby runs it on, with n2 in its
    node-failure record and the site's node health record, and says so in one line."""
    spec, site, _ = queued
    goes_on, line = standby.take_over("778", spec, site, "777")
    assert goes_on, line
    assert line.startswith("standby job 778 takes over job 777, which ended NODE_FAIL: its batch node n2 died; ")
    assert [f.node for f in node_failures.read(spec.paths(site, "778").node_failures)] == ["n2"]
    assert [(m.node, m.source) for m in health.marks(site.storage.root("scratch") / "node-health")] == [
        ("n2", "node_failure")]
    assert standby.read_link(spec.paths(site, "778").took_over) == "777"


@pytest.mark.parametrize("state", ["FAILED", "CANCELLED", "TIMEOUT", "COMPLETED"])
def test_a_standby_does_not_run_a_job_that_ended_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           state: str) -> None:
    """A job that failed by its own code, was cancelled or timed out: the standby ends at once,
    one line, nothing recorded."""
    fake_slurm(tmp_path / "bin", state)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    spec, site = job(tmp_path)
    goes_on, line = standby.take_over("778", spec, site, "777")
    assert not goes_on
    assert line == (f"standby job 778 for job 777: that job ended {JobState.from_slurm(state).value}, which its "
                    f"standby does not run on (only its batch node's death or a preemption); nothing run")
    assert not spec.paths(site, "778").took_over.exists()
    assert not node_failures.read(spec.paths(site, "778").node_failures)


def test_the_script_of_a_job_with_spares_runs_its_standby_step_and_is_not_requeued_by_slurm() -> None:
    """A job with spares: --no-requeue (its batch node's death ends it, for its standby), the
    standby step before the supervisor, which only a standby's exit 3 or own failure ends; a job
    without spares keeps Slurm's requeue and has no standby step."""
    base = ("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "resources.nodes=2")
    script = run_cli(*base, "--set", "resources.spare_nodes=1")
    assert script.code == 0, script.text
    assert "#SBATCH --no-requeue\n" in script.out and "#SBATCH --requeue\n" not in script.out
    lines = script.out.splitlines()
    step = next(i for i, line in enumerate(lines) if " -m hpcdist.runtime.standby " in line)
    assert lines[step].endswith('"$@"; hpcdist_standby=$?')
    assert lines[step + 1] == 'if [ "$hpcdist_standby" -eq 3 ]; then exit 0; fi'
    assert " -m hpcdist.runtime.in_job " in lines[step + 3]
    plain = run_cli(*base).out
    assert "#SBATCH --requeue\n" in plain and "hpcdist.runtime.standby" not in plain


def test_the_job_folder_the_standby_uses_is_submitits() -> None:
    """The folder ``JobPaths`` gives a job id is the one submitit's script names for it."""
    from hpcdist.login.plan import Origin, resolve

    site = load_site("local-slurm")
    spec = load_spec("jobs/smoke.yaml", site, ["resources.nodes=2", "resources.spare_nodes=1"])
    plan = resolve(spec, site, Origin(job_path="jobs/smoke.yaml", site_ref="local-slurm"))
    assert str(spec.paths(site, "4242").folder) == str(plan.folder).replace("%j", "4242")


def test_the_logs_of_a_job_go_on_in_the_standby_that_took_it_over(queued: tuple[JobSpec, Site, Path]) -> None:
    """``hpcdist logs`` of a job with spares: the job's own run, then each standby's that took it
    over (``took_over`` names the job), not one that is only queued."""
    from hpcdist.login.jobindex import JobRecord

    spec, site, _ = queued
    standby.queue(spec, site, "777")
    paths = spec.paths(site, "777")
    record = JobRecord(job_id="777", site=site.name, scheduler="slurm", name=spec.name, kind=spec.kind,
                       spec_path="jobs/smoke.yaml", submitted=0.0, host="login", tasks=2, nodes=2,
                       folder=str(paths.folder), stdout=str(paths.folder / "777_%t_log.out"),
                       stderr=str(paths.folder / "777_%t_log.err"), result=str(paths.result()),
                       checkpoints=str(paths.checkpoints), spec=spec.model_dump(mode="json"),
                       site_model=site.model_dump(mode="json"))
    assert [r.job_id for r in login_standby.runs(record, spec, site)] == ["777"]
    assert login_standby.continued_in(record) == ""
    took = spec.paths(site, "778").took_over
    took.write_text("777\n")
    first, then = login_standby.runs(record, spec, site)
    assert first is record and then.job_id == "778" and then.took_over == "777"
    assert login_standby.continued_in(record) == "778"  # `hpcdist jobs`: CANCELLED (run on in job 778)
    assert then.log_paths(1) == (spec.paths(site, "778").folder / "778_1_log.out",
                                 spec.paths(site, "778").folder / "778_1_log.err")
    assert then.result == str(spec.paths(site, "778").result())


def fake_running(bin_dir: Path, n2: str, port: int) -> Path:
    """Job 777 running, batch host n2 (sinfo: n2 `n2`); n2's slurmd at 127.0.0.1:`port`; squeue:
    777 cancelled, 778 (its standby) running; scancel notes its argument."""
    bin_dir.mkdir()
    calls = bin_dir / "calls"
    scripts = {
        "scontrol": (f'case "$*" in *"show job"*) echo "{SHOW.format(job="777", state="RUNNING")}";; '
                     f'*"show node"*) echo "NodeName=n2 NodeAddr=127.0.0.1 Port={port} State=IDLE";; esac\n'),
        "sinfo": f"printf 'n2|cpu*|{n2}|none\\n'\n",
        "squeue": "printf '777|sgd|CANCELLED|0:10|n[2-4]|None\\n778|sgd|RUNNING|0:01|n[3-4]|None\\n'\n",
        "scancel": f'echo "scancel $*" >> {calls}\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return calls


@pytest.mark.parametrize("n2", ["down*", "idle"])
def test_a_rank_ends_the_job_only_when_its_batch_node_is_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              n2: str) -> None:
    """A rank whose line to the supervisor timed out: with Slurm saying the batch node is down it
    names the node in the job's folder and cancels the job (for its standby); with the node idle
    and its slurmd answering (the supervisor gone on a live node) it does nothing."""
    import socket

    with socket.socket() as slurmd:
        slurmd.bind(("127.0.0.1", 0))
        slurmd.listen()
        calls = fake_running(tmp_path / "bin", n2, slurmd.getsockname()[1])
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        spec, site = job(tmp_path)
        folder = spec.paths(site, "777").folder
        folder.mkdir(parents=True)
        standby.supervisor_lost(str(folder).replace("777", "%j"), {"SLURM_JOB_ID": "777"})
    marker = spec.paths(site, "777").batch_node_died
    if n2 == "idle":
        assert not marker.exists() and not calls.exists()
        return
    assert marker.read_text() == "n2 Slurm says down*\n" and calls.read_text() == "scancel 777\n"
    assert standby.taken_over(spec, site, "777", JobState.CANCELLED) == (
        "its batch node n2 died, its rank found: Slurm says down*")


def test_cancel_of_a_job_with_spares_cancels_its_standby(queued: tuple[JobSpec, Site, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`hpcdist cancel 777` after 777 ended and its standby 778 took over: 778 is cancelled."""
    from hpcdist.login.jobindex import JobRecord

    spec, site, _ = queued
    standby.queue(spec, site, "777")
    calls = fake_running(tmp_path / "bin2", "idle", 9)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin2'}:{os.environ['PATH']}")
    record = JobRecord(job_id="777", site=site.name, scheduler="slurm", name="sgd", kind=spec.kind, spec_path="x",
                       submitted=0.0, host="login", tasks=2, nodes=2, folder="", stdout="", stderr="", result="",
                       checkpoints="", spec=spec.model_dump(mode="json"), site_model=site.model_dump(mode="json"))
    said = login_standby.cancel_chain(spec, site, record)
    assert said == "job 777 (sgd) ended CANCELLED; cancelled its standby job 778, which ran it on"
    assert calls.read_text() == "scancel 778\n"

"""`--site` means one site in every command: the YAML path (or name) a job was submitted with
finds it again in `logs`, `wait`, `cancel`, `stacks` and `hpcdist.job`, as it loads the same
site in `render` and `nodes`; a path that does not exist is one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import hpcdist
from hpcdist.scheduler.states import JobState
from tests.support.cli import REPO, Run, job_id, run_cli

NAME = "mine"  # the site's file's name: what submit records in the job index, whatever its name: says


def own_site(tmp_path: Path) -> Path:
    """A copy of the local site, its name: left as the copied file's (issue 55's finding: its
    jobs were recorded to that site), its storage under tmp_path, in conf/mine.yaml."""
    data = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    data["name"] = "local"
    data["storage"] = {key: str(tmp_path / "store" / key) for key in ("results", "checkpoints", "scratch", "logs")}
    path = tmp_path / "conf" / f"{NAME}.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    return path


def follow_ups(jid: str, site: str, cwd: Path, env: dict[str, str] | None = None) -> dict[str, Run]:
    """What a user types after `submit --site SITE`, each with the same `--site SITE`."""
    commands = {"logs": ("logs", jid), "wait": ("wait", jid), "cancel": ("cancel", jid),
                "stacks": ("stacks", jid), "nodes": ("nodes",), "render": ("render", str(REPO / "jobs/smoke.yaml"))}
    return {name: run_cli(*argv, "--site", site, cwd=cwd, env=env) for name, argv in commands.items()}


def test_every_command_finds_the_job_with_the_site_yaml_it_was_submitted_with(tmp_path: Path) -> None:
    path = own_site(tmp_path)
    submitted = run_cli("submit", "jobs/smoke.yaml", "--site", str(path), "--wait")
    assert submitted.code == 0, submitted.text
    assert f"to site {NAME} " in submitted.out
    jid = job_id(submitted.out)

    # the absolute path, the path relative to where the user is, the file's name on the search
    # path, and the name the site records
    search = {"HPCDIST_SITE_PATH": str(path.parent)}
    for site, cwd, env in ((str(path), REPO, None), (f"{NAME}.yaml", path.parent, None),
                           (NAME, REPO, search), (NAME, REPO, None)):
        got = follow_ups(jid, site, cwd, env)
        where = f"--site {site}"
        assert got["logs"].code == 0 and "[rank 0/2" in got["logs"].out, (where, got["logs"].text)
        assert got["wait"].code == 0, (where, got["wait"].text)
        assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in got["wait"].out, where
        assert got["cancel"].code == 0, (where, got["cancel"].text)
        assert got["cancel"].out.strip() == f"job {jid} (smoke) already ended: COMPLETED; nothing to cancel", where
        assert got["stacks"].code == 2, (where, got["stacks"].text)  # found, and not running
        assert f"error: job {jid} is COMPLETED, not RUNNING" in got["stacks"].err, (where, got["stacks"].text)
        if site != NAME or env:  # `nodes` and `render` load the site itself: a name needs its YAML on the search path
            assert got["nodes"].code == 0, (where, got["nodes"].text)
            assert str(tmp_path / "store" / "scratch") in got["nodes"].out, (where, got["nodes"].out)
            assert got["render"].code == 0, (where, got["render"].text)
            assert str(tmp_path / "store" / "logs" / "smoke") in got["render"].out, where

    assert hpcdist.job(jid, site=str(path)).state is JobState.COMPLETED
    assert hpcdist.job(jid, site=str(path)).record.site == NAME


@pytest.mark.parametrize("command", ["logs", "wait", "cancel", "stacks", "nodes", "render", "submit"])
def test_a_site_path_that_does_not_exist_is_one_line_naming_it(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-site.yaml"
    argv = {"nodes": (), "render": ("jobs/smoke.yaml",), "submit": ("jobs/smoke.yaml",)}.get(command, ("123",))
    result = run_cli(command, *argv, "--site", str(missing))
    assert result.code == 2, result.text
    assert result.err.strip().splitlines() == [
        f"hpcdist: error: site config '{missing}' does not exist; pass a site name or a YAML file"
    ], result.text


def test_with_no_site_named_and_no_srun_on_path_jobs_run_on_this_machine(tmp_path: Path) -> None:
    bare = tmp_path / "bin"  # not a Slurm login node: the local site, without a word (submitit's rule)
    bare.mkdir()
    shown = run_cli("render", "jobs/smoke.yaml", env={"HPCDIST_SITE": "", "PATH": str(bare)})
    assert shown.code == 0, shown.text
    assert "site 'local' runs jobs on this machine" in shown.out and "srun" not in shown.err

"""The shared-site test bed (cluster/users.sh): hpcdist run as ordinary users, not root.

alice and bob are members of group ``mlgroup``, carol is not; the group's storage root is
``GROUP_ROOT`` (root:mlgroup, 3770) and ``site_configs/local-group.yaml`` its site. They run this
checkout (first on PYTHONPATH) with the venv at ``USERS_VENV``, built from Debian's python."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.cli import REPO, Run, missing

GROUP_ROOT = Path("/var/tmp/hpcdist-group")
USERS_VENV = Path("/opt/hpcdist-users/venv")
MEMBERS, OUTSIDER = ("alice", "bob"), "carol"


def require_members() -> None:
    """Fail under `make test` (HPCDIST_REQUIRE_SLURM=1: cluster/up.sh made them), skip elsewhere,
    when the accounts, the venv or the group root are missing, or when not run as root."""
    import pwd

    why = ""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        why = "the shared-site tests switch users: run them as root (runuser)"
    else:
        try:
            for user in (*MEMBERS, OUTSIDER):
                pwd.getpwnam(user)
        except KeyError:
            why = "the test bed's accounts are missing (make cluster-up runs cluster/users.sh)"
        if not why and not (USERS_VENV / "bin" / "python").exists():
            why = f"{USERS_VENV} is missing (make cluster-up runs cluster/users.sh)"
        if not why and not GROUP_ROOT.is_dir():
            why = f"{GROUP_ROOT} is missing (make cluster-up runs cluster/users.sh)"
    if why:
        missing(why)


def as_user(user: str, *args: str, umask: str = "022", cwd: Path | None = None, timeout: float = 240,
            env: dict[str, str] | None = None) -> Run:
    """`python ARGS...` as `user` (the users' venv, this checkout first), in a clean environment
    with the shell umask `umask`, as that user would type it."""
    return run_as(user, str(USERS_VENV / "bin" / "python"), *args, umask=umask, cwd=cwd, timeout=timeout,
                  env={"PYTHONPATH": str(REPO), **(env or {})})


def run_as(user: str, *argv: str, umask: str = "022", cwd: Path | None = None, timeout: float = 240,
           env: dict[str, str] | None = None) -> Run:
    """The command `argv` as `user`, in a clean environment (HOME, USER, LOGNAME, PATH and `env`)
    with the shell umask `umask`, as that user would type it."""
    proc = subprocess.run(user_argv(user, argv, umask, env), cwd=cwd or Path(f"/home/{user}"), capture_output=True,
                          text=True, timeout=timeout, check=False)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def user_argv(user: str, argv: tuple[str, ...], umask: str = "022", env: dict[str, str] | None = None) -> list[str]:
    """What runs `argv` as `user` in `run_as`'s clean environment."""
    # the suite's site for jobs that name none (tests/support/fixtures.default_site), unless `env` says otherwise
    inherited = {"HPCDIST_SITE": os.environ["HPCDIST_SITE"]} if os.environ.get("HPCDIST_SITE") else {}
    extra = [f"{k}={v}" for k, v in {**inherited, **(env or {})}.items()]
    return ["runuser", "-u", user, "--", "env", "-i", f"HOME=/home/{user}", f"USER={user}", f"LOGNAME={user}",
            "PATH=/usr/local/bin:/usr/bin:/bin", *extra, "sh", "-c", f'umask {umask} && exec "$@"', "sh", *argv]


def spawn(user: str, *args: str, umask: str = "022") -> subprocess.Popen[str]:
    """`as_user` started in the background (several members at once)."""
    cmd = ["runuser", "-u", user, "--", "env", "-i", f"HOME=/home/{user}", f"USER={user}",
           "PATH=/usr/local/bin:/usr/bin:/bin", f"PYTHONPATH={REPO}",
           "sh", "-c", f'umask {umask} && exec "$@"', "sh", str(USERS_VENV / "bin" / "python"), *args]
    return subprocess.Popen(cmd, cwd=f"/home/{user}", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> Run:
    out, err = proc.communicate(timeout=timeout)
    return Run(proc.returncode, out, err)


# What hpcdist says where a job names no site and srun is on PATH (hpcdist.config._auto_site)
NO_SITE_LINE = "no site named: Slurm's srun is on PATH"


@dataclass
class Member:
    """An ordinary user in a project folder of hers, typing `hpcdist` and `python` there."""

    user: str
    folder: Path  # a project folder of hers, in her home
    env: dict[str, str]  # no site named; her own config and cache folders for this test

    def hpcdist(self, *args: str, timeout: float = 240) -> Run:
        return run_as(self.user, str(USERS_VENV / "bin" / "hpcdist"), *args, cwd=self.folder, env=self.env,
                      timeout=timeout)

    def python(self, *args: str, timeout: float = 240) -> Run:
        return run_as(self.user, str(USERS_VENV / "bin" / "python"), *args, cwd=self.folder, env=self.env,
                      timeout=timeout)

    def start(self, program: str, *args: str) -> subprocess.Popen[str]:
        """`program` (``hpcdist`` or ``python``) started in the background, as `hpcdist` and `python` run it."""
        return subprocess.Popen(user_argv(self.user, (str(USERS_VENV / "bin" / program), *args), env=self.env),
                                cwd=self.folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def member_in(folder: Path, files: dict[str, str], user: str = "alice", **env: str) -> Member:
    """`user`'s new project `folder` holding jobs/smoke.yaml and `files` (name: text), with no site
    named in her environment (`env` added) and her config and cache folders inside it."""
    folder.mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "smoke.yaml", folder / "smoke.yaml")
    for name, text in files.items():
        (folder / name).write_text(text)
    for path in (folder, *folder.iterdir()):
        shutil.chown(path, user, user)
    return Member(user, folder, {"PYTHONPATH": str(REPO), "HPCDIST_SITE": "",
                                 "XDG_CONFIG_HOME": str(folder / ".config"), "XDG_CACHE_HOME": str(folder / ".cache"),
                                 **env})

"""A "laptop" on the test bed: alice's hpcdist with no Slurm at all, submitting through the login
node's sshd (cluster/sshd.sh) with ``hpcdist --on login``.

Each command runs as alice in a mount namespace of its own (``unshare --mount``, made as root)
where this machine looks like a laptop: every Slurm command is a file that cannot run, /etc/slurm
and the other clusters' configs are empty, munge's socket is gone, alice's home is the laptop's
own (its ~/.ssh/config, key and known_hosts; its job index), and the group's storage root is the
laptop's own disk at the same path (made with the cluster's owners and modes), so whatever a job
needs reaches the cluster only through ssh and rsync, and its logs and results come back the
same way. The sshd runs outside, in this machine's own namespaces: traffic stays on loopback."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from tests.support.cli import REPO, Run, missing
from tests.support.members import GROUP_ROOT, USERS_VENV, require_members

SSH_STATE = Path("/var/tmp/hpcdist-ssh")  # cluster/sshd.sh's: the members' keys, the host key
PORT = int(os.environ.get("HPCDIST_SSHD_PORT") or 6822)
LAPTOP = Path("/var/tmp/hpcdist-laptop")  # the laptop's disk: alice's home and storage root there
USER = "alice"
HOST = "login"  # the Host of the laptop's ~/.ssh/config
CLOSED_PORT = 1  # login-closed: a port nothing listens on, so the connection is refused
SLURM_COMMANDS = ("sacct", "sacctmgr", "salloc", "sattach", "sbatch", "sbcast", "scancel", "scontrol", "sdiag",
                  "sinfo", "sprio", "squeue", "sreport", "srun", "sshare", "sstat", "strigger", "scrontab")
HIDDEN_DIRS = ("/etc/slurm", "/etc/slurm-variants", "/etc/slurm-releases", "/run/munge", "/var/tmp/hpcdist-releases")


def home() -> Path:
    return LAPTOP / "home" / USER


def require_login() -> None:
    """Fail under `make test` (HPCDIST_REQUIRE_SLURM=1), skip elsewhere, when the sshd is down."""
    require_members()
    probe = subprocess.run(["bash", str(REPO / "cluster" / "sshd.sh"), "show"], capture_output=True, text=True,
                           check=False)
    if "pid " not in probe.stdout or not (SSH_STATE / "users" / USER / "id_ed25519").is_file():
        missing(f"the test bed's sshd is not running ({probe.stdout.strip() or probe.stderr.strip()}); "
                f"make cluster-up starts it (cluster/sshd.sh up)")
    if shutil.which("unshare") is None:
        missing("unshare (util-linux) is needed for the laptop's mount namespace")


def setup() -> Path:
    """The laptop's home for alice (0700): ssh config, her key, and the login node's host key
    written into known_hosts; and the laptop's copy of the group's storage root. Idempotent."""
    h = home()
    ssh_dir = h / ".ssh"
    for folder, mode in ((LAPTOP, 0o755), (LAPTOP / "home", 0o755), (LAPTOP / "disk", 0o755)):
        folder.mkdir(exist_ok=True)
        os.chmod(folder, mode)
    subprocess.run(["install", "-d", "-m", "0700", "-o", USER, "-g", USER, str(h), str(ssh_dir), str(h / "work")],
                   check=True)
    key = SSH_STATE / "users" / USER / "id_ed25519"
    host_key = " ".join((SSH_STATE / "host_key.pub").read_text().split()[:2])
    files = {
        "id_ed25519": key.read_text(),
        "known_hosts": f"[127.0.0.1]:{PORT} {host_key}\n",
        "known_hosts_none": "",  # login-unverified: the same node, its host key not known
        "config": (f"Host {HOST}\n  HostName 127.0.0.1\n  Port {PORT}\n  User {USER}\n"
                   f"  IdentityFile ~/.ssh/id_ed25519\n  IdentitiesOnly yes\n"
                   f"Host {HOST}-unverified\n  HostName localhost\n  Port {PORT}\n  User {USER}\n"
                   f"  IdentityFile ~/.ssh/id_ed25519\n  IdentitiesOnly yes\n"
                   f"  UserKnownHostsFile ~/.ssh/known_hosts_none\n  StrictHostKeyChecking yes\n"
                   f"Host {HOST}-closed\n  HostName 127.0.0.1\n  Port {CLOSED_PORT}\n  User {USER}\n"),
    }
    for name, text in files.items():
        path = ssh_dir / name
        path.write_text(text)
        shutil.chown(path, USER, USER)
        os.chmod(path, 0o600)
    disk = disk_root()
    for sub in ("", "results", "checkpoints", "scratch", "logs"):  # as the cluster's admin made them
        real, mine = GROUP_ROOT / sub if sub else GROUP_ROOT, disk / sub if sub else disk
        info = real.stat()
        mine.mkdir(exist_ok=True)
        os.chown(mine, info.st_uid, info.st_gid)
        os.chmod(mine, info.st_mode & 0o7777)
    return h


def disk_root() -> Path:
    return LAPTOP / "disk" / GROUP_ROOT.name


def _namespace_script(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    lines = ["set -e", f"touch {LAPTOP}/not-here && chmod 0644 {LAPTOP}/not-here"]
    for folder in HIDDEN_DIRS:
        lines.append(f"[ ! -d {folder} ] || mount -t tmpfs -o mode=0755,size=1m none {folder}")
    for name in SLURM_COMMANDS:
        for where in ("/usr/bin", "/usr/sbin"):
            lines.append(f"[ ! -e {where}/{name} ] || mount --bind {LAPTOP}/not-here {where}/{name}")
    lines += [f"mount --bind {home()} /home/{USER}", f"mount --bind {disk_root()} {GROUP_ROOT}"]
    variables = [f"{k}={v}" for k, v in {"HOME": f"/home/{USER}", "USER": USER, "LOGNAME": USER,
                                          "PATH": "/usr/local/bin:/usr/bin:/bin", **env}.items()]
    lines.append("exec " + shlex.join(["runuser", "-u", USER, "--", "env", "-i", *variables, "sh", "-c",
                                       f"cd {shlex.quote(str(cwd))} && umask 022 && exec \"$@\"", "sh", *argv]))
    return "\n".join(lines)


def laptop_argv(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> list[str]:
    """`argv` run on the laptop as alice (the command line, for Popen)."""
    script = _namespace_script(list(argv), {"PYTHONPATH": str(REPO), **(env or {})}, cwd or Path(f"/home/{USER}"))
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]


def on_laptop(*argv: str, env: dict[str, str] | None = None, timeout: float = 240) -> Run:
    proc = subprocess.run(laptop_argv(*argv, env=env), capture_output=True, text=True, timeout=timeout, check=False)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def hpcdist_argv(*args: str) -> list[str]:
    """`hpcdist ARGS...` on the laptop: the members' venv, this checkout first on PYTHONPATH."""
    return [str(USERS_VENV / "bin" / "python"), "-m", "hpcdist.cli", *args]


def hpcdist(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> Run:
    return on_laptop(*hpcdist_argv(*args), timeout=timeout, env=env)


def close_connection() -> str:
    """The laptop's shared ssh connection ended as a dropped network ends it (its master SIGKILLed);
    what ``ssh -O check`` said of it before."""
    checked = on_laptop("ssh", "-o", f"ControlPath=/home/{USER}/.cache/hpcdist/ssh/%C", "-O", "check", HOST)
    said = checked.err.strip()
    if "pid=" in said:
        pid = int(said.split("pid=")[1].split(")")[0])
        os.kill(pid, 9)
    return said


def end_connection() -> None:
    """The shared connection closed politely (the suite leaves no master behind)."""
    on_laptop("ssh", "-o", f"ControlPath=/home/{USER}/.cache/hpcdist/ssh/%C", "-O", "exit", HOST, timeout=30)

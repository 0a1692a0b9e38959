"""Slurm's commands and a job's files over the user's own OpenSSH, for ``hpcdist --on HOST``
(``HPCDIST_LOGIN=HOST``): submitting from a laptop through a login node.

Every Slurm command ``hpcdist.scheduler.slurm.run`` runs becomes ``ssh -o ControlMaster=auto -o
ControlPath=DIR/%C -o ControlPersist=10m HOST -- 'sbatch ...'``, its words shell-quoted for the
login node's shell. The first command opens one connection and leaves it running for the next
(``ControlPersist``), so one password or 2FA prompt serves a session; ``DIR`` is the user's own 0700
folder (``~/.cache/hpcdist/ssh``), and OpenSSH reads the user's ``~/.ssh/config``, keys, agent and
ProxyJump as it always does: nothing of ssh is reimplemented here. Files go the same way: rsync
over that connection (``-e`` with the same options), to and from the same paths on both sides.

What ssh itself says when it cannot connect (exit 255: refused, host key unknown or changed, not
let in, no such host) is turned into one line that says what to do (``failure``). Standard
library only, as ``slurm`` is.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from hpcdist.errors import SubmitError

LOGIN_VAR = "HPCDIST_LOGIN"
PERSIST = "10m"  # how long the shared connection outlives the last command (ssh's ControlPersist)
SSH_FAILED = 255  # ssh's own exit code when it could not run the command at all
_chosen = ""  # `hpcdist --on HOST`: wins over $HPCDIST_LOGIN


def use(host: str) -> None:
    """Run Slurm's commands on `host` (an ssh destination: a name in ~/.ssh/config, user@host)."""
    global _chosen
    if host.startswith("-") or not host.strip() or any(c.isspace() or ord(c) < 32 for c in host):
        raise SubmitError(f"--on {host!r}: not an ssh destination (a Host of ~/.ssh/config, host or user@host)")
    _chosen = host


def login() -> str:
    """The login node Slurm's commands run on, "" where they run here."""
    return _chosen or os.environ.get(LOGIN_VAR, "").strip()


def control_dir() -> Path:
    """The user's own folder for the shared connection's socket (``~/.cache/hpcdist/ssh``, 0700):
    whoever can reach the socket can run commands as the user on the login node."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    folder = base / "hpcdist" / "ssh"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.lstat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.chmod(folder, 0o700) if info.st_uid == os.getuid() else None
        info = folder.lstat()
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise SubmitError(f"{folder} (owner uid {info.st_uid}, mode {oct(info.st_mode & 0o777)}) is not your own "
                              f"0700 folder; the ssh connection's socket goes there: remove it, then run again")
    return folder


def options() -> list[str]:
    """ssh's options for every command and copy: one shared connection, opened on first use."""
    return ["-o", "ControlMaster=auto", "-o", f"ControlPath={control_dir()}/%C", "-o", f"ControlPersist={PERSIST}",
            "-o", "ConnectTimeout=20", "-o", "ServerAliveInterval=15"]


def command(argv: Sequence[str], host: str | None = None) -> list[str]:
    """`argv` run on the login node: ssh's command line, the remote words shell-quoted."""
    if shutil.which("ssh") is None:
        raise SubmitError("`ssh` is not on PATH: --on HOST runs Slurm's commands through OpenSSH's client")
    return ["ssh", *options(), host or login(), "--", shlex.join(argv)]


def failure(host: str, stderr: str) -> str:
    """ssh's own failure (exit 255) as one line saying what to do."""
    said = " ".join(stderr.split())[-300:] or "(no message)"
    if "Host key verification failed" in stderr or "host key is known" in stderr:
        return (f"ssh {host}: its host key is not known here (or it changed): connect once with `ssh {host}` and "
                f"check the key it shows against the cluster's (or add it to ~/.ssh/known_hosts), then run again")
    if "Connection refused" in stderr:
        return (f"ssh {host}: the connection was refused ({said}); is the host or Port right in ~/.ssh/config? "
                f"`ssh {host} true` must work first")
    if "Permission denied" in stderr or "Too many authentication failures" in stderr:
        return (f"ssh {host}: not let in ({said}); load your key (ssh-add) or name it (IdentityFile in "
                f"~/.ssh/config): `ssh {host} true` must work first")
    if "Could not resolve hostname" in stderr:
        return f"ssh {host}: no such host ({said}); name a Host of ~/.ssh/config or the login node's address"
    return f"ssh {host} failed ({said}); `ssh {host} true` shows why"


class Unreachable(SubmitError):
    """ssh could not run the command on the login node (its exit 255), in one line."""


def argv_for(argv: Sequence[str]) -> list[str]:
    """`argv` as it runs: here, or through ssh on the login node under ``--on HOST``."""
    return command(argv) if login() else list(argv)


def run(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`argv` on the login node, as ``subprocess.run`` runs it (TimeoutExpired included); ssh's own
    failure is ``Unreachable``, never the command's answer."""
    host = login()
    proc = subprocess.run(command(argv, host), capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)
    if proc.returncode == SSH_FAILED:
        raise Unreachable(failure(host, proc.stderr))
    return proc


def on_login_node(argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`argv` where Slurm's commands run: on the login node under ``--on HOST``, else here. For
    what the login node itself has (its programs, its mounts, its files), not a node's."""
    if login():
        return run(argv, timeout)
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)


def programs(names: Sequence[str]) -> dict[str, str]:
    """Which of `names` are on the login node's PATH (here without ``--on``): name -> its path."""
    if not login():
        return {name: found for name in names if (found := shutil.which(name))}
    said = on_login_node(["sh", "-c", 'for p; do command -v "$p" || true; done', "sh", *names]).stdout
    paths = [line.strip() for line in said.splitlines() if line.strip().startswith("/")]
    return {name: path for name in names for path in paths if Path(path).name == name}


def missing(paths: Sequence[Path]) -> set[Path]:
    """Which of `paths` the login node does not have (a job's inputs are the cluster's files)."""
    said = run(["sh", "-c", 'for p; do test -e "$p" || echo "$p"; done', "sh", *map(str, paths)], 60.0).stdout
    return {path for path in paths if str(path) in said.splitlines()}


def where() -> str:
    """The machine `programs` and `on_login_node` ask, in words."""
    return f"on the login node ({login()})" if login() else "here"


def check(timeout: float = 60.0) -> None:
    """Open the shared connection now (``true`` on the login node), or say in one line why not."""
    try:
        run(["true"], timeout)
    except subprocess.TimeoutExpired as exc:
        raise Unreachable(f"ssh {login()}: no answer within {timeout:g} s; `ssh {login()} true` shows why") from exc


SENT = "hpcdist-sent "  # rsync's line for each file it copied (--out-format), its size after it


def _copy(argv: list[str], timeout: float, sent: Callable[[int], None]) -> subprocess.CompletedProcess[str]:
    """rsync run as ``subprocess.run`` runs it, `sent` told each file's size as it is copied."""
    proc = subprocess.Popen([*argv, f"--out-format={SENT}%l"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    said = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(SENT) and line[len(SENT):].strip().isdigit():
                sent(int(line[len(SENT):]))
            else:
                said.append(line)
        code = proc.wait()
    finally:
        killed = not timer.is_alive()
        timer.cancel()
    if killed:
        raise subprocess.TimeoutExpired(argv, timeout)
    return subprocess.CompletedProcess(argv, code, "", "".join(said))


def _rsync(args: list[str], what: str, timeout: float, missing_ok: bool = False,
           sent: Callable[[int], None] | None = None) -> None:
    if shutil.which("rsync") is None:
        raise SubmitError("`rsync` is not on PATH: --on HOST copies a job's files with it (install rsync)")
    host = login()
    argv = ["rsync", "-a", "-e", shlex.join(["ssh", *options()]), *args]
    try:
        proc = (_copy(argv, timeout, sent) if sent is not None else
                subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                               stdin=subprocess.DEVNULL))
    except subprocess.TimeoutExpired as exc:
        raise SubmitError(f"ssh {host}: copying {what} took over {timeout:g} s") from exc
    if proc.returncode == SSH_FAILED or "connection unexpectedly closed" in proc.stderr and proc.returncode == 12:
        raise SubmitError(failure(host, proc.stderr))
    if "command not found" in proc.stderr or proc.returncode == 127:
        raise SubmitError(f"ssh {host}: rsync is not installed on the login node; ask its admins for it")
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("rsync error:")]
    sender = [line for line in lines if "[sender]" in line]  # what the login node said, not our end's echo
    if missing_ok and proc.returncode == 23 and sender and all("No such file or directory" in x for x in sender):
        return  # not there (yet): a job that writes no result, a folder not made
    if proc.returncode not in (0, 24):  # 24: a file vanished while copied (a job writing)
        raise SubmitError(f"ssh {host}: copying {what} failed (rsync exit {proc.returncode}): "
                          f"{lines[0] if lines else '(no message)'}")


def put(root: Path, parts: Sequence[str], exclude: Sequence[str] = (), timeout: float = 600.0,
        sent: Callable[[int], None] | None = None) -> None:
    """Copy `root`/PARTS... (folders whole) to the same paths on the login node: `root` must be
    there, the folders below it are made with their modes here; nothing there is overwritten
    (a file that exists there is the cluster's: a log, a result). `sent` is told the size of
    each file as it is copied (a progress line)."""
    sources = [f"{root}/./{part}" for part in parts]
    _rsync(["--relative", "--ignore-existing", *(f"--exclude={e}" for e in exclude), *sources, f"{login()}:{root}/"],
           f"{', '.join(parts)} to {root}", timeout, sent=sent)


def get(folders: Sequence[Path] = (), files: Sequence[Path] = (), timeout: float = 600.0) -> None:
    """Copy `folders` (whole) and `files` from the login node to the same paths here; one missing
    there is skipped. Folders made here are the user's alone (0700)."""
    host = login()
    for path in (*folders, *files):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    for folder in folders:
        _rsync(["--ignore-missing-args", f"{host}:{folder}/", f"{folder}/"], f"{folder} from the cluster", timeout,
               missing_ok=True)
    if files:
        for path in files:
            _rsync(["--ignore-missing-args", f"{host}:{path}", str(path)], f"{path} from the cluster", timeout,
                   missing_ok=True)


def close(host: str | None = None) -> None:
    """End the shared connection to `host` (``ssh -O exit``): what a dropped network does."""
    subprocess.run(["ssh", *options(), "-O", "exit", host or login()], capture_output=True, timeout=30, check=False)

"""The suite's helpers: the CLI as a user runs it, the shared storage, the local Slurm cluster,
and reading what a submit printed. Plain functions; the fixtures are in ``tests.support.fixtures``."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = Path("/var/tmp/hpcdist-shared")


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


# `python -m hpcdist.cli` with SIGINT set first (exec keeps an ignore; a default is Python's
# KeyboardInterrupt), whatever the suite itself was started with
_WITH_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, getattr(signal, sys.argv[1])); "
                "os.execv(sys.executable, [sys.executable, '-m', 'hpcdist.cli', *sys.argv[2:]])")


def cli_argv(*args: str, sigint: str | None = None) -> list[str]:
    """The command line of `hpcdist ARGS...`; `sigint` "SIG_DFL" starts it as a terminal starts a
    foreground command (Ctrl-C reaches it), "SIG_IGN" as a shell without job control starts a
    background one (a script's `cmd &`, nohup, many CI runners); None: as this process has it."""
    if sigint is None:
        return [sys.executable, "-m", "hpcdist.cli", *args]
    return [sys.executable, "-c", _WITH_SIGINT, sigint, *args]


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 240, env: dict[str, str] | None = None,
            sigint: str | None = None) -> Run:
    """`hpcdist ARGS...` in a subprocess, as a user would type it (`sigint`: see ``cli_argv``)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(
        cli_argv(*args, sigint=sigint),
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def storage_sets(root: Path) -> list[str]:
    """`--set` arguments that move every storage root of a site under `root`."""
    out = []
    for key in ("results", "checkpoints", "scratch", "logs"):
        out += ["--set", f"site.storage.{key}={root / key}"]
    return out


def slurm_state() -> tuple[bool, str]:
    """(whether the cluster can run the 2-node tests, what sinfo says of n1 and n2)."""
    if shutil.which("sinfo") is None:
        return False, "sinfo is not installed"
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T", "-p", "cpu"], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        return False, f"sinfo: {proc.stderr.strip()[:200]}"
    states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
    # "completing": a node up and finishing a job (someone else's, or the last test's)
    up = ("idle", "mix", "alloc", "comp")
    # n1 and n2, which the 2-node tests pin; n3 and beyond may be down while a node-fault test
    # (tests/test_node_failure.py) has killed one of them
    pinned = {n: states.get(n, "missing") for n in ("n1", "n2")}
    return all(v.startswith(up) for v in pinned.values()), ", ".join(f"{n} {v}" for n, v in pinned.items())


UP_WAIT_S = 60.0  # a node a test cut off or killed is back within Slurm's SlurmdTimeout (20 s) and a ping
_found_down: list[str] = []  # once found down after the wait, later tests fail at once


def slurm_up() -> tuple[bool, str]:
    """Whether the cluster is up, waiting up to UP_WAIT_S for n1 and n2 to come back from an
    earlier test's fault (a cut link, a slurmd restarting); a cluster found down stays down."""
    if _found_down:
        return False, _found_down[0]
    deadline = time.monotonic() + UP_WAIT_S
    while True:
        up, said = slurm_state()
        if up or time.monotonic() > deadline:
            break
        time.sleep(2)
    if not up:
        _found_down.append(said)
    return up, said


# The tests that use the cluster (marked ``slurm``, or using a fixture of SLURM_FIXTURES), filled at
# collection (tests.support.fixtures): `make test` runs them one at a time in one group while the
# rest run beside them, so one test's dead or cut node never hits another test's job.
CLUSTER_TESTS: set[str] = set()
SLURM_FIXTURES = ("slurm_storage", "slurm_storage_module", "separate_hosts")
OTHER_GROUP = "other_clusters"  # the group of the tests marked other_clusters: the variants and releases only


def require_slurm() -> None:
    """Fail (under `make test`, HPCDIST_REQUIRE_SLURM=1) or skip (elsewhere) when the cluster is down.

    A test that asks for the cluster must say so (``@pytest.mark.slurm`` or a fixture of
    SLURM_FIXTURES): otherwise the parallel suite would run it beside the node-fault tests."""
    running = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    current = running.split("@", 1)[0]
    if current and current not in CLUSTER_TESTS:
        pytest.fail(f"{current} uses the Slurm cluster but is not marked: add @pytest.mark.slurm "
                    f"(tests.support.fixtures runs marked tests one at a time in the suite's cluster group)")
    if current and os.environ.get("PYTEST_XDIST_WORKER") and not running.endswith(("@cluster", f"@{OTHER_GROUP}")):
        pytest.fail(f"{current} runs beside other tests: pytest-xdist's --dist loadgroup did not group it "
                    f"(pytest-xdist issue 1386, pytest 9.2 and later); install the dev extra's pytest<9.2")
    up, said = slurm_up()
    if not up:
        missing(f"the local Slurm cluster is not up (make cluster-up): {said}")


def missing(why: str) -> NoReturn:
    """What a test needs is not here: a failure under `make test` (HPCDIST_REQUIRE_SLURM=1, where
    the set-up provides it), a skip elsewhere."""
    if os.environ.get("HPCDIST_REQUIRE_SLURM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def require_module(name: str) -> Any:
    """`name` imported; when it is missing, fail under `make test` (HPCDIST_REQUIRE_SLURM=1: the
    dev extra installs it) and skip elsewhere, like ``require_slurm``."""
    if os.environ.get("HPCDIST_REQUIRE_SLURM") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def result_path(out: str) -> Path:
    """The result file a submit printed."""
    match = re.search(r"result: (\S+)", out)
    assert match, out
    return Path(match.group(1))


def job_id(out: str) -> str:
    """The job id a submit printed."""
    match = re.search(r"submitted job (\d+)", out)
    assert match, out
    return match.group(1)


def sacct_state(jid: str) -> str:
    proc = subprocess.run(["sacct", "-j", jid, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True)
    return proc.stdout.strip()


def rank_pids(marker: str) -> dict[int, int]:
    """rank -> pid of the running ranks (``python ... -m`` submitit's task runner behind hpcdist's
    trust check) whose command line holds `marker` (the job's log folder, or its name), read from
    /proc: a local job's rank from ``SUBMITIT_LOCAL_GLOBALID``, a Slurm job's from ``SLURM_PROCID``
    (or, for a rank started again alone, ``HPCDIST_IN_PLACE``'s ranks)
    (srun's own command line names the runner too, and is left out)."""
    from hpcdist.launchers import SUBMITIT_RUNNER

    ranks = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(item.partition(b"=")[::2] for item in (proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        rank = env.get(b"SUBMITIT_LOCAL_GLOBALID", env.get(b"SLURM_PROCID"))
        if rank is not None and env.get(b"HPCDIST_IN_PLACE"):  # a rank started again alone: the rank it took
            rank = env[b"HPCDIST_IN_PLACE"].split(b";")[0].split(b",")[int(rank)]
        if (Path(argv[0].decode(errors="replace")).name.startswith("python") and SUBMITIT_RUNNER.encode() in argv
                and any(marker.encode() in a for a in argv) and rank is not None
                and b"hpcdist.runtime.in_job" not in argv):  # a job with spares: its supervisor names the runner
            ranks[int(rank)] = int(proc.name)
    return ranks

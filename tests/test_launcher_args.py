"""Launcher arguments belong to their launcher, and torchrun's rendezvous port to its job.

Switching `site.launcher.kind` as the README shows (`--set site.launcher.kind=torchrun` on
`local-slurm`, whose srun has `args: [--mpi=pmix]`) runs on the real cluster; a site's plain
`args` list stays its own kind's. torchrun's c10d store gets a port per job, and only the head
node's agent serves it: a port held by someone else is an error at once, not a quiet client.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdist.config import load_site
from tests.support.cli import REPO, run_cli, storage_sets


def launch_line(*sets: str) -> str:
    result = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", *sets)
    assert result.code == 0, result.err
    return next(line for line in result.out.splitlines() if line.startswith(("srun ", "mpirun ")))


def test_launcher_args_follow_their_kind() -> None:
    assert "--mpi=pmix" in launch_line()  # the site's srun keeps its own
    for kind in ("torchrun", "mpirun"):
        line = launch_line("--set", f"site.launcher.kind={kind}")
        assert "--mpi=pmix" not in line, line
    # a list given with --set is the arguments of the kind in effect; per-kind maps pick theirs
    assert "--bind-to core" in launch_line("--set", "site.launcher.kind=mpirun", "--set",
                                           "site.launcher.args=[--bind-to, core]")
    site = load_site("local-slurm", ["launcher.args={srun: [--mpi=pmix], mpirun: [--oversubscribe]}",
                                     "launcher.kind=mpirun"])
    assert site.launcher.line_args == ("--oversubscribe",)
    bad = run_cli("render", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "site.launcher.args={slurm: [-x]}")
    assert bad.code == 2 and "launcher.args: arguments for unknown launcher(s) slurm" in bad.err, bad.err


def test_torchrun_rendezvous_port_is_per_job() -> None:
    line = launch_line("--set", "site.launcher.kind=torchrun")
    assert '--rdzv-endpoint="$HPCDIST_HEAD_ADDR:$HPCDIST_RDZV_PORT"' in line and "29400" not in line


def test_a_held_rendezvous_port_is_an_error_on_the_head_node(tmp_path: Path) -> None:
    """torch's guess would connect to whatever holds the port; the head node's agent must bind it."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)
    port = holder.getsockname()[1]
    (tmp_path / "noop.py").write_text("print('worker ran')\n")
    env = {**os.environ, "SLURM_NODEID": "0", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hpcdist.runtime.agent", "--nnodes=1", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=t",
             str(tmp_path / "noop.py")],
            env=env, capture_output=True, text=True, timeout=40, check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the agent waited 40 s on the port's holder instead of failing")
    finally:
        holder.close()
    took = time.monotonic() - start
    assert proc.returncode != 0 and "worker ran" not in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"address already in use|EADDRINUSE", proc.stderr, re.I), proc.stderr[-2000:]
    assert took < 30, f"{took:.0f} s: the agent waited on the port's holder instead of failing"


@pytest.mark.slurm
def test_switching_to_torchrun_as_the_readme_shows_runs(slurm_storage: Path) -> None:
    result = run_cli("submit", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "site.launcher.kind=torchrun",
                     *storage_sets(slurm_storage), "--wait", timeout=240)
    assert result.code == 0, result.text
    assert "finished: COMPLETED; 2/2 ranks succeeded" in result.out, result.out
    job = re.search(r"submitted job (\d+)", result.out)
    assert job is not None
    err = "".join(p.read_text() for p in (slurm_storage / "logs" / "smoke" / job.group(1)).glob("*_log.err"))
    assert "unrecognized arguments" not in err
    ports = set(re.findall(r"endpoint [\d.]+:(\d+) via env", err))  # torchrun's store: MASTER_PORT
    assert len(ports) == 1 and ports != {"29400"}, err[-3000:]

"""Start-up of the login-side commands against a bare interpreter, alternating in one run.

Each round runs every command once, in turn, so a change of load hits all of them alike:

- ``python -c pass``: the same interpreter with its site packages: the floor (the peer);
- ``python -c 'import submitit'``: the floor of a submission, which must import submitit;
- ``python -c 'import argparse, yaml, jinja2, ...pydantic...'``: the libraries render cannot do
  without, imported alone (pydantic's first model imports ``importlib.metadata`` for its plugins);
- ``hpcdist render jobs/smoke.yaml --site local-slurm``;
- the same render from a copy of hpcdist with no bytecode, under ``PYTHONDONTWRITEBYTECODE=1``:
  what a fresh editable install (``pip install -e``) runs until ``make install`` byte-compiles it;
- with ``--against REV``, the same render from git revision REV's hpcdist (byte-compiled): a
  change's before and after in one run;
- ``hpcdist submit --help`` (the parser only);
- with ``sbatch`` on the PATH, ``hpcdist submit jobs/smoke.yaml --site local-slurm`` as a held job
  (``--set sbatch.hold=true``, storage in a temporary folder), cancelled at once: the whole
  submission, sbatch included, with nothing run.

``hpcdist`` is the console script beside this interpreter, with this checkout first on
PYTHONPATH. Its modules are byte-compiled first (``compileall``), as ``make install`` does (pip's
editable install does not: with PYTHONDONTWRITEBYTECODE set, such a checkout is compiled from
source on every run, the row without bytecode). One unmeasured run of each command fills the caches (the sbatch
template's in ``~/.cache/hpcdist``). Wall-clock medians and CPU-time medians (user + system of the
process and its children) are printed with the difference and ratio against ``python -c pass``;
on a busy machine the CPU time is the steadier figure. Last, render's time over its libraries'
import (the goal of issue 42 is at most 1.3x), with and without bytecode.

Run: .venv/bin/python benchmarks/bench_startup.py [--trials 7] [--no-submit] [--against REV]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path("/var/tmp/hpcdist-shared")  # the local cluster's shared storage (site_configs/local-slurm.yaml)
# What render imports from outside the standard library, and the standard library's argparse
LIBRARIES = "import argparse, importlib.metadata, jinja2, yaml; from pydantic import BaseModel, Field"


def hpcdist_command() -> list[str]:
    """The ``hpcdist`` console script of this interpreter (what a user runs), else its equivalent."""
    script = Path(sys.executable).parent / "hpcdist"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from hpcdist.cli import main; sys.exit(main())"]


def uncompiled_copy(dest: Path) -> Path:
    """hpcdist as a fresh editable checkout has it (its source, no ``__pycache__``), with the
    templates and site configs it finds beside the package; `dest`, for PYTHONPATH."""
    shutil.copytree(ROOT / "hpcdist", dest / "hpcdist", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("templates", "site_configs"):
        shutil.copytree(ROOT / name, dest / name)
    return dest


def revision_copy(rev: str, dest: Path) -> Path:
    """hpcdist, its templates and site configs as git revision `rev` has them, byte-compiled, in
    `dest` (for PYTHONPATH)."""
    dest.mkdir()
    archive = subprocess.run(["git", "archive", rev, "hpcdist", "templates", "site_configs"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest / "hpcdist")], check=True)
    return dest


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system, children included) and the output of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout + proc.stderr


def versions() -> str:
    names = ("pydantic", "pydantic-core", "Jinja2", "PyYAML", "submitit")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7, help="rounds; each runs every command once")
    parser.add_argument("--no-submit", action="store_true", help="leave out the held submission")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="also render with git revision REV's hpcdist (e.g. HEAD: before a change)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    hpc = hpcdist_command()
    render = [*hpc, "render", "jobs/smoke.yaml", "--site", "local-slurm"]
    commands: dict[str, list[str]] = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import submitit'": [sys.executable, "-c", "import submitit"],
        "python -c 'import <render's libraries>'": [sys.executable, "-c", LIBRARIES],
        "hpcdist render jobs/smoke.yaml --site local-slurm": render,
        "the same render, hpcdist without bytecode": render,
        "hpcdist submit --help": [*hpc, "submit", "--help"],
    }
    storage: Path | None = None
    if not args.no_submit and shutil.which("sbatch") and SHARED.is_dir():
        storage = Path(tempfile.mkdtemp(prefix="bench-startup-", dir=SHARED))
        sets = [a for key in ("results", "checkpoints", "scratch", "logs")
                for a in ("--set", f"site.storage.{key}={storage / key}")]
        commands["hpcdist submit (held, then cancelled)"] = [
            *hpc, "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--set", "sbatch.hold=true", *sets]
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    held: list[str] = []
    scratch = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    envs = {name: env for name in commands}
    envs["the same render, hpcdist without bytecode"] = {
        **env, "PYTHONPATH": str(uncompiled_copy(scratch / "uncompiled")), "PYTHONDONTWRITEBYTECODE": "1"}
    if args.against:
        name = f"the same render, hpcdist at {args.against}"
        commands[name] = render
        envs[name] = {**env, "PYTHONPATH": str(revision_copy(args.against, scratch / "revision"))}
        walls[name], cpus[name] = [], []
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "hpcdist")], check=True)
    try:
        for name, cmd in commands.items():  # one unmeasured run each: the page cache, the template cache
            _, _, out = run_once(cmd, envs[name])
            held += re.findall(r"submitted job (\d+)", out)
        for _ in range(args.trials):
            for name, cmd in commands.items():
                wall, cpu, out = run_once(cmd, envs[name])
                walls[name].append(wall)
                cpus[name].append(cpu)
                held += re.findall(r"submitted job (\d+)", out)
    finally:
        if held:
            subprocess.run(["scancel", *held], check=False)
        if storage is not None:
            shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    med = statistics.median
    floor_wall, floor_cpu = med(walls["python -c pass"]), med(cpus["python -c pass"])
    print(versions())
    print(f"{args.trials} alternating rounds, medians; load average {os.getloadavg()[0]:.2f} at the end")
    if "hpcdist submit (held, then cancelled)" not in commands:
        print("(no held submission: sbatch or the local cluster's shared storage is not here, or --no-submit)")
    print(f"{'command':52s} {'wall s':>7s} {'- peer':>7s} {'CPU s':>7s} {'- peer':>7s} {'CPU x peer':>10s}")
    for name in commands:
        wall, cpu = med(walls[name]), med(cpus[name])
        print(f"{name:52s} {wall:7.3f} {wall - floor_wall:7.3f} {cpu:7.3f} {cpu - floor_cpu:7.3f} "
              f"{cpu / floor_cpu:9.1f}x")
    libs = "python -c 'import <render's libraries>'"
    for name in (n for n in commands if "render" in n and n != libs):
        print(f"{name} / its libraries' import: wall {med(walls[name]) / med(walls[libs]):.2f}x, "
              f"CPU {med(cpus[name]) / med(cpus[libs]):.2f}x (goal: at most 1.3x)")


if __name__ == "__main__":
    main()

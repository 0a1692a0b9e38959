"""What hpcdist asks of Slurm's controller (slurmctld) and accounting (slurmdbd), against submitit's
AutoExecutor doing the same work in the same run (issue 67, item 2).

Each case runs twice, once per side, each as an ordinary user of the test bed (hpcdist as bob,
submitit as carol: no test runs as them on the release clusters), on one cluster of the test bed:

- ``result``: N jobs of S seconds submitted one by one and waited on in turn with ``.result()``;
- ``submit-wait``: N processes at once, each submitting one job and waiting on it
  (``hpcdist submit --wait``; submitit: a script that submits and calls ``.result()``);
- ``jobs``: N jobs submitted, then their states read every 10 s until all ended
  (``hpcdist jobs``; submitit: ``done()`` on each);
- ``map_array``: one array of M tasks of one second, every result waited on.

Before each side slurmctld's and slurmdbd's statistics are reset (``sdiag --reset``, ``sacctmgr
clear stats``, as root); after it, the side's user's RPC count is read from their "by user"
sections. A job-minute is one job's requested time: RPCs per job-minute = RPCs / (N x S / 60).
``--trace`` also counts each Slurm command the side ran (its own and its jobs'), through logging
wrappers first on PATH. Run as root, with the release clusters up (make cluster-up):

    .venv/bin/python benchmarks/controller_load.py --release 24.11 --jobs 20 --seconds 20 --array 200
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKOUT = REPO  # the hpcdist the users run (--checkout: another, such as `git archive` of an older commit)
USERS_VENV = Path("/opt/hpcdist-users/venv")
RELEASES_STATE = Path(os.environ.get("HPCDIST_SLURM_RELEASES_STATE", "/var/tmp/hpcdist-releases"))
RELEASES_ETC = Path("/etc/slurm-releases")
SIDES = {"hpcdist": "bob", "submitit": "carol"}
CASES = ("result", "submit-wait", "jobs", "map_array")
TRACED = ("sbatch", "squeue", "sacct", "scontrol", "sinfo", "srun", "sacctmgr", "scancel")

# One side's workload: `python WORKLOAD SIDE CASE N S` in the user's folder.
WORKLOAD = r'''
import json, os, subprocess, sys, time

side, case, n, s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
limit = max(5, int(s // 60) + 3)  # minutes: the test bed warns a job 60 s before its limit
if side == "hpcdist":
    import hpcdist
    ex = hpcdist.AutoExecutor("logs/%j", timeout_min=limit)
else:
    import submitit
    ex = submitit.AutoExecutor("logs/%j")
    ex.update_parameters(timeout_min=limit)
if case == "map_array":
    jobs = ex.map_array(time.sleep, [s] * n)
else:
    jobs = [ex.submit(time.sleep, s) for _ in range(n)]
if case == "jobs" and side == "hpcdist":
    ids = {j.job_id for j in jobs}
    cli = [os.path.join(os.path.dirname(sys.executable), "hpcdist"), "jobs", "--json", "--last", str(n)]
    while True:
        time.sleep(10)
        rows = json.loads(subprocess.run(cli, capture_output=True, text=True, check=True).stdout)
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
        if all(r["state"].split()[0] in ended for r in rows if r["job_id"] in ids):
            break
elif case == "jobs":
    while not all(j.done() for j in jobs):
        time.sleep(10)
else:
    [j.result() for j in jobs]
print("done", len(jobs))
'''
ONE = r'''
import sys, time
import submitit
ex = submitit.AutoExecutor("logs/%j")
ex.update_parameters(timeout_min=max(5, int(float(sys.argv[1]) // 60) + 3))
ex.submit(time.sleep, float(sys.argv[1])).result()
'''


@dataclass
class Side:
    case: str
    side: str
    user: str
    ctld: int
    dbd: int
    wall_s: float
    job_min: float
    commands: Counter[str] = field(default_factory=Counter)

    @property
    def per_job_min(self) -> tuple[float, float]:
        return self.ctld / self.job_min, self.dbd / self.job_min


def release_env(release: str) -> dict[str, str]:
    if release == "22.05":
        return {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    return {"PATH": f"{RELEASES_STATE}/{release}/bin:/usr/local/bin:/usr/bin:/bin",
            "SLURM_CONF": f"{RELEASES_ETC}/{release}/slurm.conf"}


def admin(release: str, program: str, *args: str) -> str:
    """A Slurm command as root on `release` (sdiag has no wrapper: the release's own binary)."""
    env = {**os.environ, **release_env(release)}
    exe = program if release == "22.05" else str(RELEASES_STATE / release / "root/usr/bin" / program)
    if release != "22.05" and program != "sdiag":
        exe = str(RELEASES_STATE / release / "bin" / program)
    proc = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode:
        raise SystemExit(f"{program} {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def by_user(text: str, user: str) -> int:
    """The user's count in the "Remote Procedure Call statistics by user" section of sdiag or
    ``sacctmgr show stats``."""
    section = text.split("statistics by user", 1)[-1]
    found = re.search(rf"^\s*{re.escape(user)}\s*\(\s*\d+\)\s*count:(\d+)", section, re.M)
    return int(found[1]) if found else 0


def as_user(user: str, argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    clean = {"HOME": f"/home/{user}", "USER": user, "LOGNAME": user, "PYTHONPATH": str(CHECKOUT), "HPCDIST_SITE": "",
             "XDG_CACHE_HOME": str(cwd / ".cache"), "XDG_CONFIG_HOME": str(cwd / ".config"),
             "XDG_STATE_HOME": str(cwd / ".state"), **env}
    return subprocess.Popen(["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in clean.items()),
                             *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], what: str, timeout: float) -> str:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"{what} exited {proc.returncode}:\n{out[-2000:]}\n{err[-3000:]}")
    return out


def tracing_path(folder: Path, env: dict[str, str]) -> str:
    """A folder of wrappers, first on PATH, that log each Slurm command to folder/commands.log."""
    bin_dir = folder / "trace-bin"
    bin_dir.mkdir()
    for name in TRACED:
        real = shutil.which(name, path=env["PATH"])
        if real is None:
            continue
        wrapper = bin_dir / name
        wrapper.write_text(f'#!/bin/sh\necho "{name} $*" >> {folder}/commands.log\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
    return f"{bin_dir}:{env['PATH']}"


def command_kind(line: str) -> str:
    """A logged command line, shortened to what it asks (``scontrol show config``, ``squeue -j``)."""
    words = line.split()
    if words[0] == "scontrol":
        rest = [w for w in words[1:] if not w.startswith("-")]
        return " ".join(["scontrol", *rest[:2]])
    if words[0] == "sacctmgr":
        rest = [w for w in words[1:] if not w.startswith("-")]
        return " ".join(["sacctmgr", *rest[:2]])
    if words[0] == "squeue":
        return "squeue -u" if "-u" in words else "squeue -s" if "-s" in words else "squeue -j"
    if words[0] == "srun":
        return "srun --mpi=list" if "--mpi=list" in words else "srun --help" if "--help" in words else "srun (a step)"
    return words[0]


def run_side(release: str, case: str, side: str, n: int, seconds: float, trace: bool) -> Side:
    user = SIDES[side]
    folder = Path(f"/home/{user}/controller-load-{uuid.uuid4().hex[:8]}")
    folder.mkdir()
    env = release_env(release)
    (folder / "workload.py").write_text(WORKLOAD)
    (folder / "one.py").write_text(ONE)
    (folder / "sleep.py").write_text("import sys, time\ntime.sleep(float(sys.argv[1]))\n")
    if trace:
        env = {**env, "PATH": tracing_path(folder, env)}
    subprocess.run(["chown", "-R", f"{user}:{user}", str(folder)], check=True)
    python = str(USERS_VENV / "bin" / "python")
    try:
        if side == "hpcdist":  # the cluster's reading, as a user has it once an hour (not counted)
            finish(as_user(user, [str(USERS_VENV / "bin" / "hpcdist"), "sites", "--show", "slurm"], folder, env),
                   "hpcdist sites --show slurm", 120)
        (folder / "commands.log").unlink(missing_ok=True)
        admin(release, "sdiag", "--reset")
        admin(release, "sacctmgr", "-i", "clear", "stats")
        t0 = time.monotonic()
        if case == "submit-wait":
            if side == "hpcdist":
                limit = max(5, int(seconds // 60) + 3)  # minutes, as the workload's
                argv = [str(USERS_VENV / "bin" / "hpcdist"), "submit", "--wait", "--set", f"resources.time_min={limit}",
                        "--", "sleep.py", f"{seconds:g}"]
            else:
                argv = [python, "one.py", f"{seconds:g}"]
            procs = [as_user(user, argv, folder, env) for _ in range(n)]
            for proc in procs:
                finish(proc, f"{side} {case}", 1800)
        else:
            count = n
            finish(as_user(user, [python, "workload.py", side, case, str(count), f"{seconds:g}"], folder, env),
                   f"{side} {case}", 3600)
        wall = time.monotonic() - t0
        time.sleep(1)  # the last completions reach the daemons
        ctld_text, dbd_text = admin(release, "sdiag"), admin(release, "sacctmgr", "show", "stats")
        ctld, dbd = by_user(ctld_text, user), by_user(dbd_text, user)
        if trace:  # every user's, by type: the cluster's own daemons' and whatever else ran there too
            for name, text in (("slurmctld", ctld_text), ("slurmdbd", dbd_text)):
                kinds = re.findall(r"^\s*([A-Z_]+)\s*\(\s*\d+\)\s*count:(\d+)", text.split("by message type")[-1]
                                   .split("by user")[0], re.M)
                print(f"    {name} by type (all users): " + ", ".join(f"{k} {v}" for k, v in kinds), flush=True)
        commands: Counter[str] = Counter()
        log = folder / "commands.log"
        if log.is_file():
            commands.update(command_kind(line) for line in log.read_text().splitlines() if line.strip())
        return Side(case, side, user, ctld, dbd, wall, n * seconds / 60.0, commands)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def versions(release: str) -> str:
    import submitit

    import hpcdist

    slurm = admin(release, "scontrol", "--version").strip()
    return f"{slurm}, hpcdist {hpcdist.__version__}, submitit {submitit.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", default="24.11", choices=("22.05", "24.11", "26.05"))
    parser.add_argument("--jobs", type=int, default=50, help="jobs of the result, submit-wait and jobs cases")
    parser.add_argument("--seconds", type=float, default=20.0, help="each job's length")
    parser.add_argument("--array", type=int, default=1000, help="tasks of the map_array case (1 s each)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--trace", action="store_true", help="count each Slurm command the sides ran")
    parser.add_argument("--checkout", type=Path, default=REPO, help="the hpcdist the users run (default: this one)")
    args = parser.parse_args()
    global CHECKOUT
    CHECKOUT = args.checkout.resolve()
    if os.geteuid() != 0:
        raise SystemExit("controller_load.py resets the daemons' statistics and switches users: run it as root")
    commit = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or CHECKOUT.name
    print(f"# {versions(args.release)} ({commit}); {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    print(f"# {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}", flush=True)
    rows: list[Side] = []
    for case in args.cases.split(","):
        n, seconds = (args.array, 1.0) if case == "map_array" else (args.jobs, args.seconds)
        for side in SIDES:
            row = run_side(args.release, case, side, n, seconds, args.trace)
            rows.append(row)
            ctld_rate, dbd_rate = row.per_job_min
            print(f"{case:12s} {side:9s} n={n:<5d} slurmctld {row.ctld:6d} ({ctld_rate:6.2f}/job-min)  slurmdbd "
                  f"{row.dbd:6d} ({dbd_rate:6.2f}/job-min)  wall {row.wall_s:6.1f} s", flush=True)
            if args.trace:
                print("    " + ", ".join(f"{k} {v}" for k, v in row.commands.most_common()), flush=True)
    print()
    print("| case | jobs | side | slurmctld RPCs | per job-minute | slurmdbd RPCs | per job-minute | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        ctld_rate, dbd_rate = row.per_job_min
        n = round(row.job_min * 60 / (1.0 if row.case == "map_array" else args.seconds))
        print(f"| {row.case} | {n} | {row.side} | {row.ctld} | {ctld_rate:.2f} | {row.dbd} | {dbd_rate:.2f} | "
              f"{row.wall_s:.0f} s |")


if __name__ == "__main__":
    main()

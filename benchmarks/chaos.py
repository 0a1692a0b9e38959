"""A chaos soak: train_gpt on the local cluster's 3 nodes plus 1 spare, submitted as a user does
(``hpcdist submit --wait``), with a fault at a random moment every ``--every`` seconds (30-90 by
default) until the job has run ``--steps`` steps or ``--faults`` faults were made. Then the same
spec runs unfaulted on the local site (3 ranks on this machine, the same gloo sums) and the two are
set side by side.

The faults, each chosen at random among those the job can take at that moment:

- ``rank_kill``: a rank's process SIGKILLed (its node lives);
- ``rank_hang``: a rank's process stopped (SIGSTOP): alive, in no collective;
- ``link_cut``: a rank node's link down for 15 s (``cluster/netfault.sh cut``, then ``restore``);
  only while the job holds a spare (a node silent that long is taken for dead);
- ``slurmd_restart``: a rank node's slurmd aborted (SIGABRT) and started again by its service loop;
- ``slurmctld_restart``: the controller stopped (SIGTERM) and started again;
- ``node_kill``: a node that runs a rank dies (``cluster/nodefault.sh kill``); only while the job
  holds a spare;
- ``batch_node_kill``: the node that runs the batch script and the job's supervisor dies; only
  while a standby job waits behind it.

A dead node is revived once the job trains again and its mark in the site's health record is
cleared (an admin's repair), so a later standby can have it. The job may restart in the job 100
times an hour (``preemption.in_job_restarts_per_hour``; the default 3 is for real faults).

For each fault the soak reports the time from the fault to the next step: the first checkpoint
committed after the last rank 0 "resumed from" that followed the fault, or, where nothing was
restarted, the end of the longest pause between commits (a checkpoint every step: a step is done
when its checkpoint is). At the end it reports the faults survived (the job completed), steps lost
(absent from the result's ``/train/steps``) and steps run twice (a step's checkpoint committed
again: the run went back past a committed step), whether every loss and the final model equal the
unfaulted run's bit for bit, and whether TensorBoard shows one run with each step once.

    .venv/bin/python benchmarks/chaos.py [--minutes 20] [--steps 14000] [--every 30 90] [--seed 1]
    .venv/bin/python benchmarks/chaos.py --faults 3 --kinds rank_kill,rank_hang,node_kill --in-turn \
        --steps 900 --every 3 6 --settle 4 --reference-alongside   # tests/test_chaos.py

It needs the 22.05 cluster (``make cluster-up``) to itself, as root: it kills its nodes and daemons.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.in_job_restart import RESUMED  # noqa: E402  (rank 0's "resumed from" line, one pattern)
from tests.support.cli import rank_pids  # noqa: E402  (the suite's reading of /proc, shared)

SHARED = Path("/var/tmp/hpcdist-shared")
STATE = Path(os.environ.get("HPCDIST_SLURM_STATE", "/var/tmp/hpcdist-slurm"))
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin"}
KINDS = ("rank_kill", "rank_hang", "link_cut", "slurmd_restart", "slurmctld_restart", "node_kill", "batch_node_kill")
CUT_S = 15
# the suite's 1-layer GPT, a checkpoint every step, validation only at the end
MODEL = ["--set", "params.model={n_layer: 1, n_head: 2, d_model: 32, context: 32}",
         "--set", "params.batch.micro=4", "--set", "params.batch.accum=1",
         "--set", "params.checkpoint.every=1", "--set", "params.checkpoint.keep_last=3",
         "--set", "params.eval.every=0", "--set", "params.log_every=50", "--set", "timeout_s=10",
         # a hang during a save's exchange waits this long (default 1800 s: a large checkpoint's write)
         "--set", "params.checkpoint.io_timeout_s=20", "--set", "resources.time_min=60",
         "--set", "tracking={tensorboard: true}",
         # a fault a minute: more in-job restarts than the site's default budget (3 an hour) allows
         "--set", "site.preemption.in_job_restarts_per_hour=100"]


def sh(*argv: str | Path, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=ENV | {
        "HOME": os.environ.get("HOME", "/root")})
    if check and done.returncode:
        raise SystemExit(f"{' '.join(map(str, argv))}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def storage(root: Path) -> list[str]:
    return [f"--set=site.storage.{k}={root / k}" for k in ("results", "checkpoints", "scratch", "logs")]


class Soak:
    """The faulted job: its folder, its process (``submit --wait``), and what its files say."""

    def __init__(self, root: Path, job: list[str]) -> None:
        self.root, self.out = root, root / "submit.out"
        cmd = [sys.executable, "-m", "hpcdist.cli", "submit", *job[:1], "--site", "local-slurm", "--wait",
               "--set", "resources.nodes=3", "--set", "resources.tasks_per_node=1", "--set", "resources.spare_nodes=1",
               "--set", "on_node_failure=requeue", *storage(root), *job[1:]]
        with self.out.open("wb") as sink:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=ENV)
        self.first_commit: dict[int, float] = {}
        self.twice: set[int] = set()

    def commits(self) -> dict[int, float]:
        """step -> commit time of the checkpoints on storage; a step committed again is noted."""
        out = {}
        for p in (self.root / "checkpoints" / "train_gpt").glob("step_*.h5"):
            try:
                step, when = int(p.stem.split("_")[1]), p.stat().st_mtime
            except FileNotFoundError:  # pruned between the listing and the look
                continue
            out[step] = when
            seen = self.first_commit.setdefault(step, when)
            if when - seen > 0.5:
                self.twice.add(step)
        return out

    def resumes(self) -> list[float]:
        logs = (p.read_text(errors="replace") for p in (self.root / "logs").rglob("*_0_log.err"))
        return sorted(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                      for text in logs for m in map(RESUMED.match, text.splitlines()) if m)

    def jobs(self) -> dict[str, tuple[str, str, list[str]]]:
        """Slurm's jobs of this soak (the job and its standbys): id -> (state, batch host, nodes)."""
        shown = sh("squeue", "-h", "-O", "JobID:16,State:16,BatchHost:16,NodeList:40,STDOUT:400", check=False)
        out = {}
        for line in shown.splitlines():
            # fixed-width columns: a pending job's batch host and nodes are blank
            jid, state, host, nodes, stdout = (line[a:b].strip() for a, b in ((0, 16), (16, 32), (32, 48), (48, 88),
                                                                                 (88, None)))
            if stdout.startswith(f"{self.root}/"):
                names = sh("scontrol", "show", "hostnames", nodes, check=False).split() if state == "RUNNING" else []
                out[jid] = (state, host, names)
        return out

    def ranks(self) -> dict[int, tuple[int, str]]:
        """rank -> (pid, node) of the running ranks."""
        out = {}
        for rank, pid in rank_pids(str(self.root / "logs")).items():
            try:
                env = dict(i.partition(b"=")[::2] for i in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            out[rank] = (pid, env.get(b"SLURMD_NODENAME", b"?").decode())
        return out


def slurmd_pid(node: str) -> int:
    return int((STATE / "run" / f"slurmd-{node}.pid").read_text())


def ctld_restart() -> None:
    pid = int((STATE / "run" / "slurmctld.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    while Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    sh("slurmctld")
    deadline = time.monotonic() + 60
    while "UP" not in sh("scontrol", "ping", check=False):
        if time.monotonic() > deadline:
            raise SystemExit("slurmctld did not answer again within 60 s")
        time.sleep(0.5)


def fault(kind: str, soak: Soak, rng: random.Random) -> tuple[float, str, Callable[[], None] | None]:
    """Make the fault; returns when (just before its act), its target, and what heals it once the
    job trains again."""
    ranks = soak.ranks()
    running = [j for j in soak.jobs().values() if j[0] == "RUNNING"]
    batch = running[0][1] if running else ""
    rank = rng.choice(sorted(ranks))
    pid, node = ranks[rank]
    t0 = time.time()
    if kind == "rank_kill":
        os.kill(pid, signal.SIGKILL)
        return t0, f"rank {rank} on {node}", None
    if kind == "rank_hang":
        os.kill(pid, signal.SIGSTOP)
        return t0, f"rank {rank} on {node}", None
    if kind == "link_cut":
        sh(ROOT / "cluster/netfault.sh", "cut", node)
        time.sleep(CUT_S)
        sh(ROOT / "cluster/netfault.sh", "restore", node)
        return t0, node, lambda: heal(soak, node, revive=False)
    if kind == "slurmd_restart":
        os.kill(slurmd_pid(node), signal.SIGABRT)  # up.sh's loop starts a crashed slurmd again
        return t0, node, None
    if kind == "slurmctld_restart":
        ctld_restart()
        return t0, "slurmctld", None
    target = batch if kind == "batch_node_kill" else node
    sh(ROOT / "cluster/nodefault.sh", "kill", target)
    return t0, target, lambda: heal(soak, target)


def heal(soak: Soak, node: str, revive: bool = True) -> None:
    """The dead node back (or, after a cut link, resumed if Slurm took it down meanwhile), and its
    mark cleared, as an admin does after a repair."""
    if revive:
        sh(ROOT / "cluster/nodefault.sh", "revive", node, timeout=300)
    elif re.search(r"down|drain|fail", sh("sinfo", "-h", "-n", node, "-o", "%T", check=False)):
        sh("scontrol", "update", f"nodename={node}", "state=resume", check=False)
    sh(sys.executable, "-m", "hpcdist.cli", "nodes", "--site", "local-slurm", *storage(soak.root), "--clear", node)


def allowed(kinds: list[str], soak: Soak) -> list[str]:
    jobs = soak.jobs()
    running = [j for j in jobs.values() if j[0] == "RUNNING"]
    out = [k for k in kinds if k not in ("node_kill", "link_cut", "batch_node_kill")]
    if running and len(running[0][2]) >= 4:  # its spare still idle: a node may die (a cut link's is taken for dead)
        out += [k for k in ("node_kill", "link_cut") if k in kinds]
    if "batch_node_kill" in kinds and running and any(j[0] == "PENDING" for j in jobs.values()):
        out.append("batch_node_kill")  # a standby waits behind it
    return out


def recovered(soak: Soak, t0: float, settle_s: float, limit_s: float = 420) -> dict[str, float]:
    """Wait until the job has committed steps for `settle_s` with no pause over 2 s and no restart
    since; the time from the fault to its next step."""
    deadline = t0 + limit_s
    while True:
        now = time.time()
        soak.commits()
        after = sorted(t for t in soak.first_commit.values() if t > t0)  # every commit seen, pruned or not
        resumes = [t for t in soak.resumes() if t > t0]
        run = [t for t in after if t > max([t0, *resumes])]
        since = run[-1] if run and now - run[-1] < 2 else None  # the start of the last stretch with no pause
        for earlier in reversed(run[:-1]):
            if since is None or since - earlier > 2:
                break
            since = earlier
        if since is not None and now - since >= settle_s:
            break
        if soak.proc.poll() is not None:
            if not after:
                raise SystemExit(f"the job ended after the fault: {soak.out.read_text()[-2000:]}")
            break
        if now > deadline:
            raise SystemExit(f"no recovery within {limit_s} s of the fault: {soak.out.read_text()[-2000:]}")
        time.sleep(0.2)
    if resumes:
        return {"next_step_s": min(t for t in after if t > resumes[-1]) - t0, "restarted": 1}
    gaps = [(b - a, b) for a, b in zip([t0, *after], after, strict=False)]
    longest, end = max(gaps)
    return {"next_step_s": (end if longest > 2 else after[0]) - t0, "restarted": 0}


def reference(job: list[str], root: Path) -> subprocess.Popen[str]:
    """The same spec unfaulted on the local site, 3 ranks (``reference_result`` reads its result
    file). Its collectives wait longer (the soak's 10 s finds hangs quickly; here a busy machine
    must not end the run), and it saves only its last step: a checkpoint changes no number of
    the run, so this also checks that the soak's thousands of saves did not."""
    root.mkdir(parents=True, exist_ok=True)
    last = next(a.split("=")[1] for a in reversed(job) if a.startswith("params.steps="))
    cmd = [sys.executable, "-m", "hpcdist.cli", "submit", *job[:1], "--site", "local", "--wait",
           "--set", "resources.nodes=1", "--set", "resources.tasks_per_node=3", *storage(root), *job[1:],
           "--set", "timeout_s=300", "--set", f"params.checkpoint.every={last}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def reference_result(proc: subprocess.Popen[str]) -> Path:
    out, _ = proc.communicate(timeout=3600)
    found = re.search(r"result: (\S+\.h5)", out)
    if proc.returncode or not found:
        raise SystemExit(f"the unfaulted run failed: {out[-3000:]}")
    return Path(found.group(1))


def compare(faulted: Path, ref: Path, soak: Soak, steps: int) -> dict[str, object]:
    import h5py
    import numpy as np

    from hpcdist.store.results import read_table

    with h5py.File(faulted) as f, h5py.File(ref) as g:
        a, b = read_table(f["train/steps"]), read_table(g["train/steps"])
        final_a, final_b = Path(str(f.attrs["checkpoint"])), Path(str(g.attrs["checkpoint"]))
    got = [int(s) for s in a["step"]]
    with h5py.File(final_a) as f, h5py.File(final_b) as g:
        model_equal = sorted(f["model"]) == sorted(g["model"]) and all(
            np.array_equal(f["model"][k][()], g["model"][k][()]) for k in f["model"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(soak.root / "logs" / "train_gpt" / "tracking" / "tensorboard"),
                           size_guidance={"scalars": 0})
    acc.Reload()
    logged = [e.step for e in acc.Scalars("loss")]
    differ = np.nonzero(np.asarray(a["loss"]) != np.asarray(b["loss"]))[0] if len(a["loss"]) == len(b["loss"]) else [0]
    return {"steps_lost": len(set(range(1, steps + 1)) - set(got)),
            "first_differing_step": int(a["step"][differ[0]]) if len(differ) else None,
            "steps_run_twice": len(soak.twice) + len(got) - len(set(got)),
            "losses_bit_for_bit": bool(np.array_equal(np.asarray(a["loss"]), np.asarray(b["loss"]))),
            "final_model_bit_for_bit": model_equal,
            "tracker_steps_once": logged == list(range(1, steps + 1))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20, help="stop making faults after this long")
    parser.add_argument("--steps", type=int, default=14000, help="train_gpt's steps (the job's length)")
    parser.add_argument("--faults", type=int, default=0, help="stop after this many faults (0: no limit)")
    parser.add_argument("--every", type=float, nargs=2, default=(30, 90), metavar=("MIN", "MAX"))
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"faults to choose from ({','.join(KINDS)})")
    parser.add_argument("--in-turn", action="store_true", help="the kinds in the order given, not at random")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--settle", type=float, default=10, help="seconds of training after a fault that count "
                        "as recovered (a restart within them is the same fault's)")
    parser.add_argument("--reference-alongside", action="store_true", help="run the unfaulted run during the soak "
                        "(sooner, for a test; the soak's times are then not figures)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here as JSON")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"--kinds: no fault {sorted(unknown)}; faults are {','.join(KINDS)}")
    rng = random.Random(args.seed)
    import torch

    from hpcdist import __version__

    slurm = sh("sinfo", "--version").strip()
    print(f"hpcdist {__version__}, torch {torch.__version__}, {slurm}; train_gpt {args.steps} steps on 3 nodes "
          f"+ 1 spare, a fault every {args.every[0]:g}-{args.every[1]:g} s, seed {args.seed}", flush=True)
    root = SHARED / f"t-chaos-{time.time_ns()}"
    root.mkdir(parents=True)
    tokens = SHARED / "t-injob-bench-tokens.h5"  # benchmarks/in_job_restart.py's, made once
    if not tokens.exists():
        sh(sys.executable, "-m", "hpcdist.cli", "data", "prepare", *sorted(map(str, (ROOT / "docs").glob("*.md"))),
           "-o", tokens)
    job = ["jobs/train_gpt.yaml", *MODEL, "--set", f"params.data={tokens}", "--set", f"params.steps={args.steps}"]
    soak, rows = Soak(root, job), list[dict[str, Any]]()
    alongside = reference(job, root / "reference") if args.reference_alongside else None
    start = time.time()
    try:
        while soak.proc.poll() is None and time.time() - start < args.minutes * 60 and (
                not args.faults or len(rows) < args.faults):
            time.sleep(rng.uniform(*args.every))
            if soak.proc.poll() is not None or not soak.ranks() or len(soak.commits()) == 0:
                continue
            can = allowed(kinds, soak)
            kind = kinds[len(rows) % len(kinds)] if args.in_turn else rng.choice(can)
            if kind not in can:
                raise SystemExit(f"--in-turn: the job cannot take {kind} now (it takes {', '.join(can)})")
            t0, target, healing = fault(kind, soak, rng)
            row = {"fault": kind, "target": target, "at_s": t0 - start, "load": os.getloadavg()[0],
                   **recovered(soak, t0, args.settle)}
            rows.append(row)
            print(f"fault {len(rows)} at {row['at_s']:.0f} s: {kind} ({target}): next step after "
                  f"{row['next_step_s']:.1f} s{', restarted' if row['restarted'] else ''} "
                  f"(load {row['load']:.1f})", flush=True)
            if healing is not None:
                healing()
        code = soak.proc.wait(timeout=3600)
        text = soak.out.read_text()
        found = re.findall(r"result:? (\S+\.h5)", text)  # the last: a standby's ("..., result F)"), when one ran on
        if code or not found:
            raise SystemExit(f"the job did not complete (exit {code}): {text[-3000:]}")
        print(f"job completed after {time.time() - start:.0f} s; the unfaulted run on the local site ...", flush=True)
        ref = alongside or reference(job, root / "reference")
        checks = compare(Path(found[-1]), reference_result(ref), soak, args.steps)
    finally:
        for node in ("n1", "n2", "n3", "n4"):
            subprocess.run([ROOT / "cluster/netfault.sh", "restore", node], capture_output=True)
        if alongside is not None and alongside.poll() is None:
            alongside.kill()
        if soak.proc.poll() is None:
            soak.proc.kill()
            for jid in soak.jobs():
                subprocess.run(["scancel", jid], capture_output=True)
    times = [float(r["next_step_s"]) for r in rows]
    report = {"faults": len(rows), "survived": len(rows), "next_step_s_median": statistics.median(times or [0]),
              "next_step_s_max": max(times, default=0), **checks, "rows": rows}
    print(f"faults survived {len(rows)}/{len(rows)}; next step median {report['next_step_s_median']:.1f} s, max "
          f"{report['next_step_s_max']:.1f} s; steps lost {checks['steps_lost']}, "
          f"run twice {checks['steps_run_twice']}; "
          f"losses bit for bit {checks['losses_bit_for_bit']}, final model {checks['final_model_bit_for_bit']}; "
          f"TensorBoard: each step once in one run {checks['tracker_steps_once']}")
    for kind in sorted({str(r["fault"]) for r in rows}):
        mine = [float(r["next_step_s"]) for r in rows if r["fault"] == kind]
        print(f"  {kind:18s} {len(mine):3d}  median {statistics.median(mine):6.1f} s  max {max(mine):6.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if checks["losses_bit_for_bit"] and checks["final_model_bit_for_bit"] and checks["tracker_steps_once"]:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    else:
        print(f"the runs differ from step {checks['first_differing_step']} or TensorBoard does not show each step "
              f"once: their files are kept in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

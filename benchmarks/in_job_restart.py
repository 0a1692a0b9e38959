"""Time from a node's death to the next training step, on the local cluster: hot spares and
in-job restart (``resources.spare_nodes``) against today's requeue, in the same run.

A user's script (tests/scripts/elastic_sgd.py: a checkpoint every step, 0.25 s a step), or
train_gpt (``--job train_gpt``: the suite's 1-layer GPT, a checkpoint every step, tokens made
once from docs/ by ``hpcdist data prepare``), is submitted through ``hpcdist submit --wait`` on
3 nodes x 1 task; once it has committed step 10,
``cluster/nodefault.sh kill`` kills a node of its step (link cut, slurmd and every process in it
killed). The time to the next training step is the time from the kill to the first checkpoint
the restarted ranks commit, after rank 0's "resumed from" (a step is done when its checkpoint
is; steps in flight at the kill may still commit before the ranks notice). Split:

- notice: the supervisor's line "node N died ... noticed at T";
- restart: to its line "in-job step 1 ... at T" (the old step killed, the node marked, the spare chosen);
- resume: to rank 0's "resumed from" (the new step's ranks started, grouped, loaded);
- first step: to the commit.

Each in-job run is one job (3 nodes + 1 spare); the requeue run is the same job with no spare
(Slurm declares the node down after SlurmdTimeout, requeues the job, holds it ~120 s, and the
waiter of ``submit --wait`` starts it on the 3 live nodes). Prints every run and the medians.

``--kill-rank``: rank 2's process is killed instead (SIGKILL; its node lives), and the in-place
restart (``on_rank_failure: in_place``: rank 2 alone in a new process, the others in theirs, the
state from their memory) is measured against the whole step's (``on_rank_failure: step``: every
rank a new process, the checkpoint read from storage), each the median of ``--runs`` jobs. Split:
restart, to the supervisor's "in-job step 1 ... at T"; resume and first step as above.

    .venv/bin/python benchmarks/in_job_restart.py [--runs 5] [--node n3] [--no-requeue] [--job train_gpt]
    .venv/bin/python benchmarks/in_job_restart.py --kill-rank [--runs 5] [--job train_gpt]
    .venv/bin/python benchmarks/in_job_restart.py --kill-batch-node [--runs 5] [--no-requeue] [--job train_gpt]

``--kill-batch-node``: the node that runs the batch script and the supervisor is killed (Slurm's
BatchHost: n1, where the job holds all four nodes); the job ends NODE_FAIL and its standby job
(``hpcdist.runtime.standby``) runs it on on the three live nodes. Split: ended, to the job's end in
Slurm (EndTime, whole seconds); takeover, to the standby's record that it took over (its file's
time); resume, to the standby's rank 0 "resumed from"; first step as above. Beside it, unless
``--no-requeue``, one run of the job with no spare whose batch node is killed (Slurm's requeue).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path("/var/tmp/hpcdist-shared")
NOTICED = re.compile(r"node (\S+) died .* noticed at ([\d.]+)")
STEP1 = re.compile(r"in-job step 1 on (\S+) .* at ([\d.]+)")
KEEP = "--keep" in sys.argv  # each run's folder kept
RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0/\d+ [^]]*\] INFO resumed from ")


# train_gpt: a 1-layer GPT of ~25k parameters (the suite's), a checkpoint every step
TRAIN_GPT = ["jobs/train_gpt.yaml", "--set", "params.model={n_layer: 1, n_head: 2, d_model: 32, context: 32}",
             "--set", "params.batch.micro=4", "--set", "params.batch.accum=1", "--set", "params.steps=3000",
             "--set", "params.checkpoint.every=1", "--set", "params.checkpoint.keep_last=3",
             "--set", "params.eval.every=1000", "--set", "params.log_every=10"]
SCRIPT = ["--", "tests/scripts/elastic_sgd.py", "--steps", "400", "--every", "1", "--step-s", "0.25"]


def submit(root: Path, spares: int, job: list[str], on_rank: str) -> tuple[subprocess.Popen[bytes], Path]:
    sets = [f"--set=site.storage.{k}={root / k}" for k in ("results", "checkpoints", "scratch", "logs")]
    out = root / "submit.out"
    spec, rest = (job[:1], job[1:]) if job[0].endswith(".yaml") else ([], job)
    cmd = [sys.executable, "-m", "hpcdist.cli", "submit", *spec, "--site", "local-slurm", "--set", "resources.nodes=3",
           "--set", "resources.tasks_per_node=1", "--set", f"resources.spare_nodes={spares}",
           "--set", "on_node_failure=requeue", "--set", "timeout_s=10", "--set", f"on_rank_failure={on_rank}",
           *sets, "--wait", *rest]
    with out.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/local/bin:/usr/bin:/bin"})
    return proc, out


def committed(ckpts: Path) -> dict[int, float]:
    out = {}
    for p in ckpts.glob("step_*.h5"):
        try:
            out[int(p.stem.split("_")[1])] = p.stat().st_mtime
        except FileNotFoundError:  # pruned between the listing and the look
            continue
    return out


def batch_host(jid: str) -> str:
    shown = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True).stdout
    return re.search(r" BatchHost=(\S+)", shown).group(1)  # type: ignore[union-attr]


def end_time(jid: str) -> float:
    shown = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True).stdout
    return datetime.strptime(re.search(r" EndTime=(\S+)", shown).group(1), "%Y-%m-%dT%H:%M:%S").timestamp()  # type: ignore[union-attr]


def one(node: str, spares: int, limit_s: float, job: list[str], on_rank: str = "") -> dict[str, float]:
    """One job, `node` killed after step 10 (or rank 2's process, with `on_rank`: in_place or step;
    its batch node, with `node` "batch")."""
    from tests.support.cli import rank_pids

    root = SHARED / f"t-injob-bench-{time.time_ns()}"
    root.mkdir(parents=True)
    proc, out = submit(root, spares, job, on_rank or "in_place")
    ckpts = root / "checkpoints" / ("train_gpt" if job[0].endswith(".yaml") else "elastic_sgd")
    jid = ""
    try:
        deadline = time.monotonic() + 120
        while max(committed(ckpts), default=0) < 10:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the job did not reach step 10: {out.read_text()[-2000:]}")
            time.sleep(0.1)
        jid = re.search(r"submitted job (\d+)", out.read_text()).group(1)  # type: ignore[union-attr]
        if node == "batch":
            node = batch_host(jid)
        if on_rank:
            pid = rank_pids(str(root / "logs"))[2]
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
        else:
            killed = time.time()  # the kill's first act is cutting the node's link
            subprocess.run([ROOT / "cluster/nodefault.sh", "kill", node], check=True, capture_output=True)
        deadline = time.monotonic() + limit_s
        while True:  # the first step the restarted ranks commit: after rank 0's "resumed from"
            log = "\n".join(p.read_text(errors="replace") for p in sorted((root / "logs").rglob("*_0_log.err")))
            resumed = [datetime.strptime(r.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                       for r in map(RESUMED.match, log.splitlines()) if r]
            after = [t for t in committed(ckpts).values() if resumed and t > resumed[-1]]
            if after:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"no step within {limit_s} s of the kill: {out.read_text()[-2000:]}")
            time.sleep(0.2)
        first = min(after)
        row = {"next_step_s": first - killed}
        if on_rank and (s := STEP1.search(log)):
            row |= {"restart_s": float(s.group(2)) - killed, "resume_s": resumed[-1] - float(s.group(2)),
                    "first_step_s": first - resumed[-1]}
        elif spares and (took := next((root / "logs").rglob("*_took_over"), None)):
            taken = took.stat().st_mtime
            row |= {"ended_s": end_time(jid) - killed, "takeover_s": taken - killed, "resume_s": resumed[-1] - taken,
                    "first_step_s": first - resumed[-1]}
        elif (m := NOTICED.search(log)) and (s := STEP1.search(log)):
            row |= {"notice_s": float(m.group(2)) - killed, "restart_s": float(s.group(2)) - float(m.group(2)),
                    "resume_s": resumed[-1] - float(s.group(2)), "first_step_s": first - resumed[-1]}
        return row
    finally:
        if not on_rank:
            subprocess.run([ROOT / "cluster/nodefault.sh", "revive", node], capture_output=True)
        if jid:  # the job and its standbys
            subprocess.run([sys.executable, "-m", "hpcdist.cli", "cancel", jid], cwd=ROOT, capture_output=True,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/local/bin:/usr/bin:/bin"})
            subprocess.run(["scancel", jid], capture_output=True)
        proc.wait(timeout=120)
        if not KEEP:
            subprocess.run(["rm", "-rf", str(root)], check=False)
        else:
            print(f"kept {root}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--node", default="n3")
    parser.add_argument("--no-requeue", action="store_true")
    parser.add_argument("--job", choices=("script", "train_gpt"), default="script")
    parser.add_argument("--kill-rank", action="store_true", help="kill rank 2's process: in-place against whole step")
    parser.add_argument("--kill-batch-node", action="store_true", help="kill the batch node: the standby job")
    parser.add_argument("--keep", action="store_true", help="keep each run's folder (logs, checkpoints) to read")
    args = parser.parse_args()
    job = SCRIPT
    if args.job == "train_gpt":
        tokens = SHARED / "t-injob-bench-tokens.h5"
        if not tokens.exists():
            docs = sorted(map(str, ROOT.glob("docs/*.md")))
            subprocess.run([sys.executable, "-m", "hpcdist.cli", "data", "prepare", *docs, "-o", str(tokens)], cwd=ROOT,
                           check=True, env={"PYTHONPATH": str(ROOT)})
        job = [*TRAIN_GPT, "--set", f"params.data={tokens}"]
    import torch

    import hpcdist

    slurm = subprocess.run(["sinfo", "-V"], capture_output=True, text=True).stdout.strip()
    print(f"hpcdist {hpcdist.__version__}, torch {torch.__version__}, {slurm}; {args.job}, killing "
          f"{'rank 2' if args.kill_rank else 'the batch node' if args.kill_batch_node else args.node} after step 10")
    keys = ("next_step_s", "notice_s", "ended_s", "takeover_s", "restart_s", "resume_s", "first_step_s")
    if args.kill_rank:
        return kill_rank(args.runs, job, keys)
    node = "batch" if args.kill_batch_node else args.node
    rows = []
    for n in range(args.runs):
        row = one(node, 1, 180, job)
        rows.append(row)
        print(f"{'standby' if args.kill_batch_node else 'in-job'} run {n + 1}: "
              + "  ".join(f"{k} {row[k]:.2f}" for k in keys if k in row), flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
    lo, hi = min(r["next_step_s"] for r in rows), max(r["next_step_s"] for r in rows)
    said = "  ".join(f"{k} {v:.2f}" for k, v in med.items())
    print(f"{'standby' if args.kill_batch_node else 'in-job'} median: {said}  (range {lo:.2f}-{hi:.2f})")
    if not args.no_requeue:
        row = one(node, 0, 400, job)
        print(f"requeue (no spare), 1 run: next_step_s {row['next_step_s']:.1f}; "
              f"ratio requeue / in-job median {row['next_step_s'] / med['next_step_s']:.1f}")
    return 0


def kill_rank(runs: int, job: list[str], keys: tuple[str, ...]) -> int:
    """Rank 2's process killed: the in-place restart against the whole step's, each `runs` jobs."""
    medians = {}
    for mode in ("in_place", "step"):
        rows = []
        for n in range(runs):
            rows.append(one("", 1, 120, job, mode))
            print(f"{mode} run {n + 1}: " + "  ".join(f"{k} {rows[-1][k]:.2f}" for k in keys if k in rows[-1]),
                  flush=True)
        med = {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
        lo, hi = min(r["next_step_s"] for r in rows), max(r["next_step_s"] for r in rows)
        print(f"{mode} median: " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()) + f"  (range {lo:.2f}-{hi:.2f})")
        medians[mode] = med["next_step_s"]
    print(f"ratio step / in_place: {medians['step'] / medians['in_place']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Submission and bootstrap cost on the local Slurm cluster, against a plain `sbatch`.

Measures, side by side in one run:
- wall time of `hpcdist submit` (a new process: imports, validation, render, submitit) against
  `sbatch` of the very same rendered script (a new process too);
- bootstrap time at 4 ranks (2 nodes x 2 tasks): launch -> process group ready, with the import
  of torch reported separately, read back from the smoke jobs' result files.

Run: .venv/bin/python benchmarks/bench_submit.py [--trials 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py

from hpcdist.store.results import read_table

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], **kw: object) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, **kw)  # type: ignore[call-overload]
    return time.perf_counter() - t0, proc.stdout + proc.stderr


def wait_done(job_ids: list[str], limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i"], capture_output=True, text=True)
        if not out.stdout.strip():
            return
        time.sleep(1)
    raise SystemExit(f"jobs {job_ids} still queued after {limit_s} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-submit-", dir="/var/tmp/hpcdist-shared"))
    sets = ["--set", "resources.nodes=2"]
    for key in ("results", "checkpoints", "scratch", "logs"):
        sets += ["--set", f"site.storage.{key}={root / key}"]
    hpc = [sys.executable, "-m", "hpcdist.cli"]
    script = subprocess.run([*hpc, "render", "jobs/smoke.yaml", "--site", "local-slurm", *sets],
                            capture_output=True, text=True, check=True, cwd=ROOT).stdout
    script_path = root / "plain.sbatch"
    script_path.write_text(script)
    submit_s, sbatch_s, ids = [], [], []
    for _ in range(args.trials):
        dt, out = timed([*hpc, "submit", "jobs/smoke.yaml", "--site", "local-slurm", *sets])
        submit_s.append(dt)
        ids.append(re.search(r"submitted job (\d+)", out).group(1))  # type: ignore[union-attr]
        dt, out = timed(["sbatch", str(script_path)])
        sbatch_s.append(dt)
        wait_done(ids[-1:] + [re.search(r"job (\d+)", out).group(1)])  # type: ignore[union-attr]
    results = sorted((root / "results" / "smoke").glob("*.h5"))
    ready, rendezvous, entry, torch_s = [], [], [], []
    for path in results:
        with h5py.File(path) as f:
            boot = read_table(f["bootstrap"])
        ready.append(float(boot["launch_to_ready_s"].max()))
        rendezvous.append(float((boot["rendezvous_s"] + boot["init_process_group_s"]).max()))
        entry.append(float(boot["launch_to_entry_s"].max()))
        torch_s.append(float(boot["import_torch_s"].max()))
    imports = []
    for _ in range(args.trials):  # import torch alone, in 4 fresh processes on the 2 nodes
        seconds = subprocess.run(
            ["srun", "-N2", "--ntasks-per-node=2", sys.executable, "-c",
             "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"],
            capture_output=True, text=True, check=True,
        ).stdout.split()
        imports.append(max(float(x) for x in seconds))
    med = statistics.median
    print(f"trials: {args.trials} (medians; 2 nodes x 2 tasks on the local Slurm cluster)")
    print(f"hpcdist submit (new process)  : {med(submit_s):6.3f} s")
    print(f"plain sbatch of the same script: {med(sbatch_s):6.3f} s")
    print(f"ratio submit / sbatch          : {med(submit_s) / med(sbatch_s):6.2f}x")
    print(f"bootstrap, launch -> group ready (slowest of 4 ranks): {med(ready):6.3f} s over {len(ready)} jobs")
    print(f"  launch -> hpcdist entry (python, submitit, unpickle): {med(entry):6.3f} s")
    print(f"  import torch inside the bootstrap (slowest rank)   : {med(torch_s):6.3f} s")
    print(f"  import torch alone under srun (slowest of 4)       : {med(imports):6.3f} s")
    print(f"  of which rendezvous + init_process_group           : {med(rendezvous):6.3f} s")


if __name__ == "__main__":
    main()

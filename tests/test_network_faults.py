"""Network faults between the local cluster's two nodes (cluster/netfault.sh, tests/netfault.py):
n2's link cut during an all_reduce sweep and during training, and slowed during the node-pair
matrix and the preflight. What a user must see: every surviving rank fails within the job's
timeout naming the operation and the node it cannot reach, the job ends FAILED (not TIMEOUT),
what was measured or committed is kept, and a slow link is named with its pairs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py

from hpcdist.config import load_site
from hpcdist.config.contract import IMITATE_ABORT_VAR
from hpcdist.store.records import health
from hpcdist.store.results import read_table
from tests.netfault import cut, slowed
from tests.support import train as fx
from tests.support.cli import REPO, run_cli, sacct_state
from tests.support.train import ckpt_dir, rank_log, train_args, wait_for

JOBS = REPO / "jobs"
train_root, tokens = fx.train_root, fx.tokens  # the training tests' session fixtures (token file)
TIMEOUT_S = 10  # the job's collective timeout: a cut is noticed within it
PINNED = "sbatch.nodelist=n1,n2"  # the job must hold n2, the node these tests cut or slow (of 4)


def storage(root: Path) -> list[str]:
    return [f"--set=site.storage.{k}={root / k}" for k in ("results", "checkpoints", "scratch", "logs")]


def start(job: str, root: Path, *sets: str) -> subprocess.Popen[str]:
    """`hpcdist submit JOB --wait` in the background; its output is read once it ends."""
    args = [sys.executable, "-m", "hpcdist.cli", "submit", str(JOBS / f"{job}.yaml"), "--site", "local-slurm",
            "--wait", "--wait-timeout", "240", *storage(root), f"--set={PINNED}", *(f"--set={s}" for s in sets)]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows(path: Path, table: str) -> int:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return len(read_table(f[table])["size"]) if table in f else 0
    except (OSError, KeyError):
        return 0


def only_result(root: Path) -> Path | None:
    found = list((root / "results").rglob("*.h5"))
    return found[0] if found else None


def cut_n2_until_both_fail(job: subprocess.Popen[str], ready: Callable[[], object], what: str, logs: Path,
                           error: str) -> str:
    """Once `ready()`, cut n2's link until rank 0 (n1) and rank 1 (n2) have both logged `error`,
    then restore it; returns the `--wait` output of the job, checked to have ended FAILED with
    the cut noticed within the job's timeout."""
    try:
        wait_for(ready, 120, what)
        with cut("n2"):
            t_cut = time.monotonic()
            wait_for(lambda: both_failed(read_logs(logs), error), TIMEOUT_S * 2 + 20, "both ranks to fail")
            noticed = time.monotonic() - t_cut
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert noticed < TIMEOUT_S * 1.25 + 10, noticed
    assert job.returncode == 1, out + err
    jid = re.search(r"submitted job (\d+)", out).group(1)  # type: ignore[union-attr]
    assert f"job {jid} finished: FAILED" in out and sacct_state(jid) == "FAILED"  # not TIMEOUT
    return out


def test_cut_link_during_all_reduce_sweep(separate_hosts: Path) -> None:
    job = start("bench_collectives", separate_hosts, "resources.nodes=2", "resources.tasks_per_node=1",
                "params.ops=[all_reduce]", "params.paths=[torch]", "params.modes=[in_place]",
                "params.min_bytes=1K", "params.max_bytes=64M", "params.factor=2", "params.iters=20",
                f"timeout_s={TIMEOUT_S}")
    table = "bench/all_reduce/torch"
    out = cut_n2_until_both_fail(job, lambda: (p := only_result(separate_hosts)) and rows(p, table) >= 3,
                                 "three measured rows", separate_hosts / "logs", "BenchmarkError: all_reduce at size")
    # each side names the operation and the node it cannot reach
    assert re.search(r"rank 0: FAILED BenchmarkError: all_reduce at size \d+ B .* on path torch/gloo .* failed on "
                     r"rank 0 \(n1\): .*Timed out.*; no answer within 5 s from n2 \(rank 1\)", out), out
    assert re.search(r"rank 1: FAILED BenchmarkError: all_reduce at size .* failed on rank 1 \(n2\): .*; "
                     r"n1 does not answer", out), out
    path = only_result(separate_hosts)
    assert path is not None
    with h5py.File(path, "r") as f:  # the rows measured before the cut stay in the result
        assert not bool(f.attrs["complete"]) and f.attrs["verdict"].startswith("failed at all_reduce")
        assert "no answer within 5 s from n2 (rank 1)" in f.attrs["verdict"]
    assert rows(path, table) >= 3
    # n2 goes into the site's node health record, once, from rank 0 (n2 cannot tell its own cut from n1's)
    site = load_site("local-slurm", [s.removeprefix("--set=site.") for s in storage(separate_hosts)])
    assert [(m.node, m.source) for m in health.marks(site)] == [("n2", "timeout")]


# NCCL's watchdog aborted 15 to 60 s after the timeout on an H100 (docs/gpus.md); here the cut must
# end within Slurm's SlurmdTimeout (20 s), or n2 is declared failed: a shorter timeout and window
ABORT_TIMEOUT_S, ABORT_AFTER_S = 5, 9  # rank 1, cut off, hears no roll call for 7 s


def test_cut_link_under_a_backend_that_aborts_as_nccl_does(separate_hosts: Path) -> None:
    """Under NCCL a timed-out collective raises nothing in Python: torch's watchdog aborts every
    rank (SIGABRT). gloo made to do the same (its collectives never raise; a thread aborts the rank
    9 s after the timeout, while the job thread is still blocked in the all_reduce): the summary
    still names n2 (rank 1) as the node that stopped answering, the rows so far are kept and n2
    is marked in the health record, all written in the window before the abort."""
    job = start("bench_collectives", separate_hosts, "resources.nodes=2", "resources.tasks_per_node=1",
                "params.ops=[all_reduce]", "params.paths=[torch]", "params.modes=[in_place]",
                "params.min_bytes=1K", "params.max_bytes=64M", "params.factor=2", "params.iters=20",
                f"timeout_s={ABORT_TIMEOUT_S}", f"env.{IMITATE_ABORT_VAR}={ABORT_AFTER_S}")
    table, logs = "bench/all_reduce/torch", separate_hosts / "logs"
    try:
        wait_for(lambda: (p := only_result(separate_hosts)) and rows(p, table) >= 3, 120, "three measured rows")
        with cut("n2"):  # until both ranks aborted: a link back in time would let the all_reduce finish
            wait_for(lambda: read_logs(logs).count("aborting the rank (SIGABRT)") == 2, 30, "both ranks' abort")
            time.sleep(0.5)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, out + err
    assert "Traceback" not in read_logs(logs)  # Python saw no exception: the ranks were aborted
    assert re.search(r"rank 0: FAILED BenchmarkError: all_reduce at size \d+ B .* failed on rank 0 \(n1\): "
                     # the cut meets the all_reduce, or the gather of its timings after it (runtime.plain's
                     # gather_plain: gather, broadcast, gather)
                     r"TimeoutError: (all_reduce|all_gather|gather|broadcast) #\d+ \(default_pg\) "
                     r"did not complete within 5 s; "
                     r"the backend \(imitating NCCL's watchdog\) ends this rank; "
                     r"no answer within 5 s from n2 \(rank 1\).*"
                     r"\(complete=False\) \(then killed by SIGABRT on n1\)", out), out
    assert re.search(r"rank 1: FAILED BenchmarkError: all_reduce at size .* failed on rank 1 \(n2\): .*"
                     r"n1 does not answer.* \(then killed by SIGABRT on n2\)", out), out
    assert "stacks at the timeout" in out, out
    # the job's cause: the rank srun saw end first, by its own error before the signal that ended it
    assert re.search(r"cause: rank [01] on n[12] went first: BenchmarkError: all_reduce at size .* "
                     r"\(then killed by SIGABRT\)", out), out
    path = only_result(separate_hosts)
    assert path is not None and rows(path, table) >= 3
    with h5py.File(path, "r") as f:  # the rows measured before the cut stay in the result
        assert not bool(f.attrs["complete"]) and f.attrs["verdict"].startswith("failed at all_reduce")
        assert "no answer within 5 s from n2 (rank 1)" in f.attrs["verdict"]
    site = load_site("local-slurm", [s.removeprefix("--set=site.") for s in storage(separate_hosts)])
    assert [(m.node, m.source) for m in health.marks(site)] == [("n2", "timeout")]


def both_failed(logs: str, error: str) -> bool:
    """Rank 0 (n1) and rank 1 (n2) have each logged `error`."""
    return all(re.search(re.escape(error) + rf".* failed on rank {r} \({n}\)", logs) for r, n in ((0, "n1"), (1, "n2")))


def read_logs(logs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in logs.rglob("*_log.err"))


# n2's link at 20 Mbit/s both ways (2.5 MB/s): a node pair over it moves about 0.0025 GB/s,
# against 0.1 GB/s and more unslowed here; the minimum sits between.
SLOW_RATE = "20mbit"
MIN_P2P = "0.02"
PAIRS = ["params.size=256K", "params.iters=3", "params.window=4", "params.warmup=1"]


def finish(job: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = job.communicate(timeout=120)
    return job.returncode, out + err


def test_slowed_link_marks_n2s_pairs_in_the_matrix_and_the_report(separate_hosts: Path) -> None:
    with slowed("n2", rate=SLOW_RATE):
        code, out = finish(start("bench_pairs", separate_hosts, f"site.baselines.min_p2p_gbps={MIN_P2P}", *PAIRS))
    assert code == 1, out
    assert "finished: FAILED" in out
    assert re.search(r"short of the site's minimum 0.02 GB/s: n1->n2 0\.00\d+ GB/s, n2->n1 0\.00\d+ GB/s; "
                     r"nodes that fell short: .*n2 \(2 links\)", out), out
    path = only_result(separate_hosts)
    assert path is not None
    with h5py.File(path, "r") as f:  # the matrix is kept, with the verdict naming n2's pairs
        assert f.attrs["verdict"].startswith("below minimum") and "n2->n1" in f.attrs["verdict"]
        bw = f["pairs/torch/bandwidth_gbps"][()]
        assert bw[0, 1] < float(MIN_P2P) and bw[1, 0] < float(MIN_P2P)
    plots = separate_hosts / "plots"
    shown = subprocess.run([sys.executable, "-m", "hpcdist.cli", "report", str(path), "--plot", str(plots)],
                           capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"n1 .*-.* 0\.00\d+ SLOW", shown.stdout) and re.search(r"n2 .* 0\.00\d+ SLOW .*-", shown.stdout)
    assert "# SLOW: n1->n2, n2->n1 below the site's minimum 0.02 GB/s" in shown.stdout, shown.stdout
    png = plots / "pairs_torch.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_slowed_link_fails_the_preflight_naming_n2(separate_hosts: Path) -> None:
    with slowed("n2", rate=SLOW_RATE):
        code, out = finish(start("bench_preflight", separate_hosts, f"site.baselines.min_p2p_gbps={MIN_P2P}",
                                 "params.sizes_bytes=[64K]", "params.pair_size=256K", "params.iters=3",
                                 "params.warmup=1"))
    assert code == 1, out
    assert "finished: FAILED" in out and "below the site's minimum" in out
    assert "n1->n2" in out and "n2->n1" in out and "n2 (2 links)" in out, out


def test_cut_link_during_training_keeps_the_checkpoint_and_resumes(separate_hosts: Path, train_root: Path,
                                                                   tokens: Path) -> None:
    root = separate_hosts
    args = train_args(root, tokens, "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1",
                      "--set", PINNED, "--set", "params.steps=5000", "--set", f"timeout_s={TIMEOUT_S}",
                      site="local-slurm")
    job = subprocess.Popen([sys.executable, "-m", "hpcdist.cli", *args], cwd=REPO, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = cut_n2_until_both_fail(job, (ckpt_dir(root) / "step_00000050.h5").exists, "the first committed checkpoint",
                                 root / "logs", "JobError: training step")
    kept = re.search(r"rank 0: FAILED JobError: training step \d+ \([^)]*\) failed on rank 0 \(n1\): "
                     r".*; no answer within 5 s from n2 \(rank 1\).*; resubmit to resume from (\S+\.h5)", out)
    assert kept, out
    assert re.search(r"rank 1: FAILED JobError: training step .* on rank 1 \(n2\): .*n1 does not answer", out), out
    # the last committed checkpoint is valid: a resubmission resumes from it
    step = int(Path(kept.group(1)).stem.split("_")[1])
    again = run_cli(*train_args(root, tokens, "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1",
                                "--set", "params.steps=5000", "--set", "params.run_steps=5", site="local-slurm"))
    assert again.code == 0, again.text
    assert f"resumed from {kept.group(1)}: step {step}" in rank_log(root, 0)

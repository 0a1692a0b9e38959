"""Fixtures for the training tests: a small corpus and token file made here, the training job
as a user submits it (tiny model, one thread per rank), and checkpoint comparisons."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from tests.support.cli import REPO, SHARED, Run, cli_argv, run_cli, storage_sets

STEPS = 400
# A 1-layer GPT of ~25k parameters: 400 steps take a few seconds on one core per rank.
TINY = [
    "--set", "params.model={n_layer: 1, n_head: 2, d_model: 32, context: 32}",
    "--set", "params.batch.micro=4", "--set", "params.batch.accum=1",
    "--set", f"params.steps={STEPS}", "--set", "params.checkpoint.every=50",
    "--set", "params.checkpoint.keep_last=2", "--set", "params.eval.every=100",
    "--set", "params.log_every=10", "--set", "timeout_s=60",
]


def write_corpus(path: Path, words: int = 12000, seed: int = 0) -> Path:
    """Sentences of made-up words from a fixed vocabulary: ~70 KB, the same every time."""
    rng = np.random.default_rng(seed)
    vocab = ["".join(rng.choice(list("etaoinshrdlucmfw"), size=rng.integers(2, 8))) for _ in range(300)]
    picks = rng.zipf(1.3, size=words) % len(vocab)
    text = []
    for i, w in enumerate(picks):
        text.append(vocab[w] + (".\n" if i % 11 == 10 else " "))
    path.write_text("".join(text))
    return path


@pytest.fixture(scope="session")
def train_root() -> Iterator[Path]:
    """A directory on the cluster's shared storage (so Slurm jobs see it), removed at the end."""
    base = SHARED if SHARED.is_dir() and os.access(SHARED, os.W_OK) else Path("/tmp")
    root = base / f"t-train-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def prepare_tokens(root: Path, name: str, words: int = 12000) -> Path:
    """`hpcdist data prepare` of a `write_corpus` of `words` words: root/NAME.h5."""
    corpus = write_corpus(root / f"{name}.txt", words=words)
    out = root / f"{name}.h5"
    result = run_cli("data", "prepare", str(corpus), "-o", str(out))
    assert result.code == 0, result.text
    return out


@pytest.fixture(scope="session")
def tokens(train_root: Path) -> Path:
    return prepare_tokens(train_root, "tokens")


def train_args(root: Path, tokens: Path, *extra: str, site: str = "local") -> list[str]:
    return [
        "submit", "jobs/train_gpt.yaml", "--site", site, "--wait",
        *storage_sets(root), "--set", f"params.data={tokens}", *TINY, *extra,
    ]


def train(root: Path, tokens: Path, *extra: str, site: str = "local", timeout: float = 240) -> Run:
    return run_cli(*train_args(root, tokens, *extra, site=site), timeout=timeout)


def ckpt_dir(root: Path) -> Path:
    return root / "checkpoints" / "train_gpt"


def final_checkpoint(root: Path, step: int = STEPS) -> Path:
    return ckpt_dir(root) / f"step_{step:08d}.h5"


def rank_log(root: Path, rank: int = 0) -> str:
    return "".join(p.read_text() for p in sorted((root / "logs" / "train_gpt").glob(f"*/train_rank{rank}.log")))


def model_arrays(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: d[()] for k, d in f["model"].items()}


def differing(a: Path, b: Path) -> list[str]:
    """Names of /model datasets that are not bit-identical between two checkpoints."""
    x, y = model_arrays(a), model_arrays(b)
    assert sorted(x) == sorted(y)
    return [k for k in x if not np.array_equal(x[k], y[k])]


@pytest.fixture(scope="session")
def reference(train_root: Path, tokens: Path) -> Path:
    """The uninterrupted run every resumed run must equal: its final checkpoint."""
    root = train_root / "reference"
    result = train(root, tokens)
    assert result.code == 0, result.text
    assert "2/2 ranks succeeded" in result.out
    return final_checkpoint(root)


class Background:
    """`hpcdist submit ... --wait` running in the background while a test interferes; what it
    has printed so far is readable while it runs (`printed`), so a test can act on a line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(  # as a terminal starts it: `kill` is a Ctrl-C, wherever the suite runs
            cli_argv(*args, sigint="SIG_DFL"), cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers = [threading.Thread(target=to.extend, args=(pipe,), daemon=True)  # line by line
                         for pipe, to in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()

    def printed(self) -> str:
        """Its stdout so far."""
        return "".join(self._out)

    def finish(self, timeout: float) -> Run:
        self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return Run(self.proc.returncode, "".join(self._out), "".join(self._err))

    def kill(self) -> None:
        """A user's Ctrl-C: `submit --wait` stops waiting and leaves the job running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=10)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def queue_state(jid: str) -> str:
    """The job's state and reason in Slurm's queue, or "" once it has left it."""
    return subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T %r"], capture_output=True, text=True).stdout.strip()


def preempt_and_release(jid: str, signal_name: str, *, batch: bool = False) -> None:
    """Send Slurm job `jid` the preemption signal, wait until it is requeued, and release it at
    once (Slurm holds a requeued job for ~2 minutes, BeginTime) so a test stays short.

    ``signal_name="requeue"``: preempt it as Slurm's PreemptMode=REQUEUE does (``scontrol
    requeue``): SIGTERM to every process of the job, SIGKILL KillWait seconds later, requeued by Slurm."""
    if signal_name == "requeue":
        subprocess.run(["scontrol", "requeue", jid], check=True)
    else:
        subprocess.run(["scancel", *(["--batch"] if batch else []), f"--signal={signal_name}", jid], check=True)
    wait_for(lambda: queue_state(jid).startswith("PENDING"), 60, "the job to be requeued (PENDING)")
    # not at once: a restart within the second of the requeue finds the old run's credential
    # revoked ("Killing non-startable batch job: Job credential revoked", Slurm 22.05) and fails
    time.sleep(2)
    start_now(jid)


def start_now(jid: str) -> None:
    """Start pending Slurm job `jid` now (BeginTime=now). The update also runs Slurm's scheduler at
    once, where a BeginTime that merely passes waits for its next periodic pass (10-15 s here)."""
    subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], check=True)


def assert_completed_after_one_requeue(jid: str, result: Any, ranks: int) -> None:
    """`submit --wait` (`result`, a Run) ended COMPLETED with every rank, and Slurm's accounting
    shows the job requeued exactly once before it completed."""
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; {ranks}/{ranks} ranks succeeded" in result.out
    history = subprocess.run(["sacct", "-j", jid, "-X", "-n", "-P", "--duplicates", "-o", "State"],
                             capture_output=True, text=True).stdout.split()
    assert history == ["REQUEUED", "COMPLETED"], history


TWO_NODES = ["--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1"]


def slurm_job(root: Path, name: str = "train_gpt") -> str:
    """The Slurm job id of job `name`'s run under `root` (its folder in the logs root)."""
    return next(p.name for p in (root / "logs" / name).iterdir() if p.name.isdigit())


def stopped_at(log: str, signal_name: str) -> int:
    match = re.search(rf"{signal_name} signal received: checkpointing at step (\d+)", log)
    assert match, log[-3000:]
    return int(match.group(1))


def preempted_once(args: list[str], root: Path, name: str, ready: Callable[[], bool], what: str, how: str,
                   finish_s: float = 180) -> tuple[str, Any]:
    """`hpcdist ARGS` (a ``submit --wait`` of job `name` into `root`) in the background, preempted
    `how` (``preempt_and_release``) once `ready` holds (`what`, within 120 s), waited to its end:
    (job id, the submit command's result)."""
    job = Background(args)
    try:
        wait_for(ready, 120, what)
        jid = slurm_job(root, name)
        preempt_and_release(jid, how)
        return jid, job.finish(timeout=finish_s)
    finally:
        job.kill()


def preempted_slurm_run(root: Path, tokens: Path, how: str, *sets: str) -> tuple[str, Any]:
    """A 2-node training job on the cluster, preempted `how` once rank 0 logged step 20, waited to
    its end: (job id, the submit command's result)."""
    return preempted_once(train_args(root, tokens, *TWO_NODES, *sets, site="local-slurm"), root, "train_gpt",
                          lambda: "step 20/400" in rank_log(root), "step 20 in rank 0's log", how)

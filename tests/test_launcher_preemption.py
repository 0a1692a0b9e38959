"""The preemption signal under the launchers that put a process between Slurm and the ranks:
torchrun's agent (which must survive it) and mpirun (which runs in the batch step, which a plain
`--signal=USR2@N` leaves out: its ranks on the first node never got the signal). On the real
local cluster, 2 nodes x 1 task: the signal sent as the script's `#SBATCH --signal` asks
(`scancel --signal=USR2`, with `--batch` for `B:`) reaches every rank, the job checkpoints,
requeues itself and resumes from that checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpcdist.store.results import read_attrs
from tests.support import train as fx
from tests.support.cli import result_path
from tests.support.train import STEPS, Background, preempt_and_release, rank_log, train_args, wait_for

train_root, tokens = fx.train_root, fx.tokens

LAUNCHERS = {
    "torchrun": ["--set", "site.launcher.kind=torchrun", "--set", "site.launcher.args=[]"],
    "mpirun": ["--set", "site.launcher.kind=mpirun", "--set", "site.launcher.args=[]"],
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_preemption_requeues_and_resumes_under(launcher: str, separate_hosts: Path, train_root: Path,
                                               tokens: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = train_root / f"preempt-{launcher}"
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")  # the cluster runs jobs as root; sbatch passes these on
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    job = Background(train_args(root, tokens, "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1",
                                "--set", "sbatch.nodelist=n1,n2", *LAUNCHERS[launcher], site="local-slurm"))
    try:
        wait_for(lambda: "step 20/400" in rank_log(root), 120, "step 20 in rank 0's log")
        jid = next(p.name for p in (root / "logs" / "train_gpt").iterdir() if p.name.isdigit())
        script = (root / "logs" / "train_gpt" / jid / f"{jid}_submission.sh").read_text()
        batch = ["--batch"] if "#SBATCH --signal=B:USR2@" in script else []
        assert batch == (["--batch"] if launcher == "mpirun" else [])
        preempt_and_release(jid, "USR2", batch=bool(batch))
        result = job.finish(timeout=180)
    finally:
        job.kill()
    assert result.code == 0, result.text
    assert f"job {jid} finished: COMPLETED; 2/2 ranks succeeded" in result.out
    logs = "".join(p.read_text() for p in (root / "logs" / "train_gpt" / jid).glob("*_log.err"))
    if launcher == "torchrun":  # each node's agent got the signal too, and lived on
        assert logs.count("USR2 (preemption) noted; the workers handle it, the agent stays") == 2, logs[-3000:]
    else:  # the batch shell handed it to mpirun, which sent it to every rank
        assert "mpirun: Forwarding signal 12 to job" in logs, logs[-3000:]
    log = rank_log(root, 0)
    stopped = int(re.search(r"USR2 signal received: checkpointing at step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert 20 <= stopped < STEPS
    assert f"resumed from {root / 'checkpoints' / 'train_gpt' / f'step_{stopped:08d}.h5'}: step {stopped}" in log
    attrs = read_attrs(result_path(result.out))
    assert attrs["requeues"] == 1 and attrs["final_step"] == STEPS and attrs["hosts"] == ["n1", "n2"]

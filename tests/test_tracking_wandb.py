"""W&B as a user meets it, with no W&B server: an unchanged script that calls ``wandb.init()``
continues the job's run after Slurm requeues it (each start its own offline folder, one run id),
and ``hpcdist track sync JOB`` hands W&B's own ``wandb sync`` the job's offline folders in order.
"""

from __future__ import annotations

import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError

from tests.support import train as fx
from tests.support import wandb_log
from tests.support.cli import require_slurm, run_cli, storage_sets
from tests.support.train import preempted_once
from tests.test_tracking import read_key

train_root = fx.train_root
PLAIN_WANDB = Path(__file__).parent / "scripts" / "wandb_plain.py"


def offline_files(folder: Path) -> list[Path]:
    """The run files of each start, oldest first (W&B names the folders by their start time)."""
    return sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))


def logged_steps(folder: Path) -> list[int]:
    """The steps in the newest start's offline file so far (a record being written is not one yet)."""
    try:
        return [row["_step"] for row in wandb_log.history(offline_files(folder)[-1])]
    except (IndexError, OSError, ValueError, AssertionError, struct.error, DecodeError):
        return []


@pytest.mark.slurm
def test_an_unchanged_script_continues_its_wandb_run_after_a_requeue(train_root: Path) -> None:
    """`wandb.init()` with no argument, in a script with no hpcdist call: the job's environment
    (WANDB_RUN_ID, WANDB_RESUME=allow, WANDB_DIR, WANDB_MODE=offline) names its run, so after Slurm
    requeues the job the script logs on into the same run id, each step once."""
    require_slurm()
    root = train_root / "plain-wandb"
    state, folder = root / "state.txt", root / "logs" / "wandb_plain" / "tracking"
    jid, result = preempted_once(
        ["submit", "--site", "local-slurm", "--wait", *storage_sets(root), "--set", "tracking.wandb={project: plain}",
         "--", str(PLAIN_WANDB), str(state), "150"], root, "wandb_plain",
        lambda: len(logged_steps(folder)) >= 10, "step 10 in the script's offline W&B file", "requeue", finish_s=120)
    assert result.code == 0, result.text
    out = "".join(p.read_text() for p in (root / "logs" / "wandb_plain" / jid).glob("*_log.out"))
    started = re.findall(r"wandb run (\w+) from step (\d+)", out)
    key = read_key(folder)
    assert [run_id for run_id, _ in started] == [key, key] and started[1][1] != "0", out
    files = offline_files(folder)
    assert len(files) == 2 and set().union(*(wandb_log.run_ids(f) for f in files)) == {key}
    first, second = ([row["_step"] for row in wandb_log.history(f)] for f in files)
    resumed = int(started[1][1])
    # the first start's file up to its last flush (W&B's process dies with Slurm's SIGTERM: at most its
    # last second is lost, 1 s / 0.03 s a step), the second start from where the script resumed
    assert first == list(range(len(first))) and 10 <= len(first) <= resumed and resumed - len(first) <= 40
    assert second == list(range(resumed, 150))
    rows = [row for f in files for row in wandb_log.history(f)]
    assert all(row["x"] == row["_step"] * 0.5 for row in rows)

    # the sync a user runs on the login node: W&B's own command over this job's folders, in order
    shown = run_cli("track", "sync", jid, "--site", "local-slurm", "--print")
    assert shown.code == 0, shown.text
    command = shlex.split(shown.out.strip().splitlines()[-1])
    assert command == [str(Path(sys.executable).with_name("wandb")), "sync", *(str(f.parent) for f in files)]
    dry = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, timeout=60)
    assert "Would sync 2 run(s)" in dry.stdout + dry.stderr, dry  # W&B takes that command line

"""Run submitit's task runner under a launcher whose ranks carry the wrong Slurm task variables.

submitit names each task's result by SLURM_PROCID; under mpirun or torchrun every process of a
node inherits the same value. The launcher that started this rank (found from its environment
table) says what to set (``Launcher.task_env``); then ``submitit.core._submit`` takes over.
"""

from __future__ import annotations

import os
import sys

from hpcdist.launchers import owner_of
from hpcdist.runtime.rankinfo import RankInfo


def main() -> None:
    info = RankInfo.from_env(os.environ)
    launcher = owner_of(info.launcher)
    if launcher is not None:
        os.environ.update(launcher.task_env(info))
    from hpcdist.runtime.task_runner import main as run_submitted

    sys.exit(run_submitted(sys.argv[1:]))


if __name__ == "__main__":
    main()

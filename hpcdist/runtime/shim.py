"""Run submitit's task runner under mpirun or torchrun, where Slurm's per-task variables are wrong.

submitit names each task's result by SLURM_PROCID; under mpirun or torchrun every process of a
node inherits the same value. This shim sets the SLURM_* task variables from the launcher's own
(detected by ``RankInfo``) and then hands over to ``submitit.core._submit``.
"""

from __future__ import annotations

import os
import sys

from hpcdist.runtime.rankinfo import RankInfo


def slurm_task_env(info: RankInfo) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(info.rank),
        "SLURM_LOCALID": str(info.local_rank),
        "SLURM_NTASKS": str(info.world_size),
        "SLURM_NODEID": str(info.node_rank),
    }


def main() -> None:
    os.environ.update(slurm_task_env(RankInfo.from_env(os.environ)))
    from submitit.core.submission import submitit_main

    sys.argv = ["submitit", *sys.argv[1:]]
    submitit_main()


if __name__ == "__main__":
    main()

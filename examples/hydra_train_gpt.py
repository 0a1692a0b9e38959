"""A Hydra app whose every job is one train_gpt run: sweep its learning rate with hpcdist's launcher.

    python examples/hydra_train_gpt.py -m hydra/launcher=hpcdist hydra.launcher.nodes=2 \
        params.data=tokens.h5 params.optim.lr=1e-3,6e-4,3e-4,1e-4

Each value is one hpcdist job on 2 nodes (on Slurm one job array): the task runs on every rank,
after hpcdist's bootstrap, and hands the rank to train_gpt's loop with this job's parameters, which
are train_gpt's own (docs/jobs.md). Job N of the sweep is the hpcdist job ``hydra_train_gpt-N``,
whose checkpoints it resumes from after a preemption. Rank 0's summary (final loss, tokens/s) is
the job's return value; with ``hydra.launcher.wait=false`` the sweep returns once it is queued.
"""

from __future__ import annotations

import sys
from typing import Any

try:
    import hydra
    from omegaconf import DictConfig, OmegaConf
except ImportError:  # hpcdist installed without its Hydra extra: one line saying what to do, not a traceback
    sys.exit("hpcdist: error: this example is a Hydra app and Hydra is not installed in this Python "
             f"({sys.executable}): pip install 'hpcdist[hydra]', then run it again")


@hydra.main(version_base=None, config_path=".", config_name="hydra_train_gpt")
def main(cfg: DictConfig) -> dict[str, Any]:
    import hpcdist
    from hpcdist.train.loop import run
    from hpcdist.train.params import TrainParams

    params = OmegaConf.to_container(cfg.params, resolve=True)
    assert isinstance(params, dict)
    params["data"] = hydra.utils.to_absolute_path(str(params["data"]))
    ctx = hpcdist.init()
    return run(ctx.job, TrainParams.model_validate(params))


if __name__ == "__main__":
    main()

"""A training script that knows W&B and nothing of hpcdist: it opens its run with ``wandb.init()``
(the job's run, from WANDB_RUN_ID, WANDB_RESUME, WANDB_DIR and WANDB_MODE) and keeps its own step
in a file. On SIGTERM (a preemption) it stops logging, ends its run and waits to be requeued.

python wandb_plain.py STATE_FILE STEPS
"""

import os
import signal
import sys
import time
from pathlib import Path

import wandb

state, steps = Path(sys.argv[1]), int(sys.argv[2])
stopping: list[int] = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
start = int(state.read_text()) if state.exists() else 0
if os.environ.get("RANK", "0") == "0":
    run = wandb.init()
    print(f"wandb run {run.id} from step {start}", flush=True)
    for step in range(start, steps):
        if stopping:
            print(f"stopping at step {step}", flush=True)
            time.sleep(60)  # Slurm kills and requeues the job
        run.log({"x": step * 0.5}, step=step)
        state.write_text(str(step + 1))
        time.sleep(0.03)
    run.finish()
print("done", flush=True)

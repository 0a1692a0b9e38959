"""A training script that knows MLflow and nothing of hpcdist: it opens its run with
``mlflow.start_run()`` (the job's run, from MLFLOW_RUN_ID and MLFLOW_TRACKING_URI) and keeps its own
step in a file. On SIGTERM (a preemption) it stops logging and waits to be requeued.

python mlflow_plain.py STATE_FILE STEPS
"""

import os
import signal
import sys
import time
from pathlib import Path

import mlflow

state, steps = Path(sys.argv[1]), int(sys.argv[2])
stopping: list[int] = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
start = int(state.read_text()) if state.exists() else 0
if os.environ.get("RANK", "0") == "0":
    with mlflow.start_run() as run:
        print(f"mlflow run {run.info.run_id} from step {start}", flush=True)
        for step in range(start, steps):
            if stopping:
                print(f"stopping at step {step}", flush=True)
                time.sleep(60)  # Slurm kills and requeues the job
            mlflow.log_metric("x", step * 0.5, step=step)
            state.write_text(str(step + 1))
            time.sleep(0.03)
print("done", flush=True)

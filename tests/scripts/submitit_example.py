"""A submitit script, written against submitit's documented API (its README and docs/examples.md:
executors by name, Slurm's own parameter names, ``helpers``), run by tests/test_submitit_names.py
as it is and with only its import line changed to ``import hpcdist as submitit``.

    python tests/scripts/submitit_example.py FOLDER [--slurm]

Prints one JSON line of what each part returned."""

import json
import os
import sys

import submitit


def add(a, b):
    return a + b


def where(tag):
    env = submitit.JobEnvironment()
    return {"tag": tag, "rank": env.global_rank, "tasks": env.num_tasks, "pid": os.getpid()}


class Counter(submitit.helpers.Checkpointable):
    def __init__(self, start=0):
        self.start = start

    def __call__(self, steps):
        return self.start + steps


finished: list[submitit.Job[int]] = []  # submitit's generic Job, as scripts annotate it


def main(folder, slurm):
    said = {}
    # LocalExecutor: this machine, whatever srun says
    local = submitit.LocalExecutor(folder=f"{folder}/local/%j")
    local.update_parameters(timeout_min=2)
    jobs = local.map_array(add, [1, 2], [10, 20])
    said["local_map"] = sorted(job.result() for job in submitit.helpers.as_completed(jobs))
    job = local.submit(Counter(5), 3)
    said["checkpointable"] = job.result()
    said["local_env"] = local.submit(where, "local").result()["tasks"]
    # DebugExecutor: in this process
    debug = submitit.DebugExecutor(folder=f"{folder}/debug")
    said["debug_in_process"] = debug.submit(where, "debug").result()["pid"] == os.getpid()
    said["delayed"] = submitit.helpers.DelayedSubmission(add, 4, 5).result()
    with submitit.helpers.clean_env():
        said["clean_env"] = "SLURM_JOB_ID" not in os.environ
    if slurm:
        # SlurmExecutor: submitit's Slurm parameter names
        ex = submitit.SlurmExecutor(folder=f"{folder}/slurm/%j")
        ex.update_parameters(partition="cpu", time=2, nodes=1, ntasks_per_node=1, cpus_per_task=1, mem="1GB",
                             job_name="submitit-names", signal_delay_s=30)
        job = ex.submit(add, 2, 3)
        said["slurm"] = [job.result(), job.state]
    print(json.dumps(said))


if __name__ == "__main__":
    main(sys.argv[1], "--slurm" in sys.argv[2:])

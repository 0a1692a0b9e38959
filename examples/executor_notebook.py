# %% [markdown]
# # hpcdist from Python (a notebook, cell by cell)
#
# Submit a function to every rank of a job, get every rank's return value back. Run it as a
# script (`python examples/executor_notebook.py [SITE]`) or paste the cells into a notebook.
# The site defaults to `local` (no Slurm: the ranks run on this machine); `local-slurm` is the
# two-node cluster of `make cluster-up`.

# %%
import sys

import hpcdist

SITE = sys.argv[1] if len(sys.argv) > 1 else "local"
NODES = 2 if SITE != "local" else 1


# %% A function defined here (in __main__, or a notebook cell) travels by value.
def mean_of_ranks(ctx: hpcdist.Context, scale: float) -> dict[str, float]:
    """Runs on every rank after hpcdist's bootstrap: the process group is ready."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(ctx.rank) * scale])
    dist.all_reduce(value)
    return {"rank": ctx.rank, "host": ctx.hosts[ctx.rank], "mean": value.item() / ctx.world_size}


# %% One job of NODES x 2 ranks; `submit` returns at once.
ex = hpcdist.Executor(site=SITE, nodes=NODES, tasks_per_node=2, time_min=5,
                      set={"site.launcher.args": []} if SITE != "local" else None)
job = ex.submit(mean_of_ranks, 10.0)
print("submitted", job.job_id, job.state.value)

# %% Every rank's value (waits; a failed rank raises hpcdist.JobFailed naming it).
for value in job.results():
    print(value)


# %% A job array: one job per item, at most two at a time on Slurm.
def square(x: int) -> int:
    return x * x


squares = ex.map_array(square, [1, 2, 3], max_parallel=2)
print([j.result() for j in squares])

# %% Later, from any process: re-attach by id.
again = hpcdist.job(job.job_id)
print(again.state.value, again.result())

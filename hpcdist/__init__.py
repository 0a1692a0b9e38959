"""hpcdist: distributed PyTorch work on Slurm clusters, from a site config and a job spec.

The package follows the job's flow: ``config`` (site config, job spec) -> ``render`` (sbatch
script) -> ``submit`` (submitit) on the login node, then on the nodes ``runtime`` (rank
bootstrap, process group) -> ``jobs`` (the workloads) -> ``results`` / checkpoints.
Only ``cli`` imports both sides.
"""

__version__ = "0.1.0"

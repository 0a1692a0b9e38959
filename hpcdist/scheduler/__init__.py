"""The scheduler, one owner for both sides: job states, the Slurm client, the live cluster's facts
and the local site's jobs as processes (``local_jobs``).

``states`` maps every word a scheduler uses to one ``JobState``; ``slurm`` is the only code that
runs a Slurm command (each with a timeout and retries; a failure is "unknown", never "gone"),
with a batched, cached watcher for many jobs; ``slurm_cluster`` reads what a live cluster is;
how a job ended is the login side's (``hpcdist.login.postmortem``). No torch and no submitit:
the login side, the nodes (requeue, the checkpoint claim) and the launchers import it alike.
"""

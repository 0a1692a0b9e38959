"""The scheduler, one owner for both sides: job states, the Slurm client, and how a job ended.

``states`` maps every word a scheduler uses to one ``JobState``; ``slurm`` is the only code that
runs a Slurm command (each with a timeout and retries; a failure is "unknown", never "gone"),
with a batched, cached watcher for many jobs; ``postmortem`` reads how a job ended from the
accounting and the batch log. No torch and no submitit: the login side, the nodes (requeue,
the checkpoint claim) and the launchers import it alike.
"""

"""Per-job sbatch options (``sbatch: {exclusive: true, mail_type: END}`` in a job spec), checked.

Names are sbatch's long options (``mail_type`` and ``mail-type`` both name ``--mail-type``),
checked against the list in sbatch's manual (Slurm 22.05 to 24.x), with the nearest name
suggested for a typo. Options that hpcdist sets from other keys are refused with the key to use,
so one thing never has two owners. A value ``true`` is a bare flag, ``false`` leaves it out.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

# sbatch's long options (`man sbatch`), less those that only make sense on sbatch's command line.
SBATCH_OPTIONS = frozenset("""
account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint container
contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
distribution error exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind gpu-freq gpus
gpus-per-node gpus-per-socket gpus-per-task gres gres-flags hint hold ignore-pbs input job-name kill-on-invalid-dep
licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill
no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket
open-mode output overcommit oversubscribe partition power prefer priority profile propagate qos reboot requeue
reservation signal sockets-per-node spread-job switches thread-spec threads-per-core time time-min tmp
tres-per-task uid use-min-nodes wait-all-nodes wckey
""".split())

# Options hpcdist writes itself, and where a job spec sets them instead.
OWNED = {
    "job-name": "name", "partition": "resources.partition", "nodes": "resources.nodes",
    "ntasks": "resources.nodes and resources.tasks_per_node", "ntasks-per-node": "resources.tasks_per_node",
    "cpus-per-task": "resources.cpus_per_task", "gpus-per-node": "resources.gpus_per_node",
    "mem": "resources.mem_gb", "time": "resources.time_min", "output": "the site's storage.logs",
    "error": "the site's storage.logs", "open-mode": "nothing (hpcdist appends to the logs)",
    "signal": "the site's preemption.signal and preemption.seconds_before_end",
    "requeue": "nothing (hpcdist jobs requeue on preemption)", "array": "`hpcdist submit --sweep`",
}

SbatchValue = bool | int | float | str


def _check(options: dict[str, SbatchValue]) -> dict[str, SbatchValue]:
    """`options` with sbatch's spelling of each name, or a ValueError naming the bad one."""
    out: dict[str, SbatchValue] = {}
    for key, value in options.items():
        name = key.replace("_", "-")
        if name in OWNED:
            raise ValueError(f"{key!r} is set by hpcdist; set {OWNED[name]} instead")
        if name not in SBATCH_OPTIONS:
            import difflib  # only for the message

            near = difflib.get_close_matches(name, sorted(SBATCH_OPTIONS - set(OWNED)), n=1)
            hint = f"did you mean {near[0].replace('-', '_')!r}?" if near else "see `man sbatch` for the long options"
            raise ValueError(f"{key!r} is not an sbatch option; {hint}")
        if value is not False:
            out[name] = value
    return out


SbatchOptions = Annotated[dict[str, SbatchValue], AfterValidator(_check)]

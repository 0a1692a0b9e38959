"""Slurm's sbatch options: the one table of those hpcdist writes itself, and the check of the
free-form ones a job spec adds (``sbatch: {exclusive: true, mail_type: END}``).

``PARAMETERS`` holds, once for each option hpcdist writes, its ``#SBATCH`` spelling, the key that
sets it (a job spec's, or the site's), submitit's names for the same value, and the name
submitit's executor is given it by, in the order the script writes them (as submitit's
``_make_sbatch_string`` is that one function's signature). The plan (``hpcdist.login.plan``)
fills it in; the script, submitit's executor and ``hpcdist.Executor``'s submitit names all read
it, and so does the check below: an option hpcdist writes is refused in a job's ``sbatch:`` with
the key to use, so one thing never has two owners.

Free-form names are sbatch's long options (``mail_type`` and ``mail-type`` both name
``--mail-type``), checked against the list in sbatch's manual (Slurm 22.05 to 24.x), with the
nearest name suggested for a typo. A value ``true`` is a bare flag, ``false`` leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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

SbatchValue = bool | int | float | str


@dataclass(frozen=True)
class Parameter:
    """One sbatch option hpcdist writes: its ``#SBATCH --OPTION``, the key that sets it, and
    submitit's names for it."""

    option: str
    key: str  # what sets it: a job spec key (resources.nodes), the site's, or hpcdist itself
    submitit: tuple[str, ...] = ()  # submitit's names that carry the same value (slurm_X or bare), for the key
    executor: tuple[str, str] | None = None  # the name submitit's (Slurm, local) executor is given the value by
    owned: bool = True  # a job's own sbatch: may not set it (False: the job's value wins, or is merged)
    yields: bool = False  # not written where the site's or the job's own sbatch: sets it (theirs is)
    written: bool = True  # a line of the script (False: only refused, ntasks follows from two keys)


# In the script's order: the job's shape first, then its logs, signal and requeue, then what the
# submission adds (an array, the jobs it waits for, the variables it takes from the shell).
PARAMETERS = (
    Parameter("job-name", "name", ("job_name",)),
    Parameter("partition", "resources.partition", ("partition",)),
    Parameter("nodes", "resources.nodes", ("nodes",), executor=("nodes", "nodes")),
    Parameter("ntasks", "resources.nodes and resources.tasks_per_node", written=False),
    Parameter("ntasks-per-node", "resources.tasks_per_node", ("ntasks_per_node", "tasks_per_node"),
              executor=("ntasks_per_node", "tasks_per_node")),
    Parameter("cpus-per-task", "resources.cpus_per_task", ("cpus_per_task",)),
    Parameter("gpus-per-node", "resources.gpus_per_node", ("gpus_per_node",)),
    Parameter("gres", "resources.gpus_per_node, with the site's gpu_request: gres", owned=False),
    Parameter("mem", "resources.mem_gb", ("mem_gb",)),
    Parameter("time", "resources.time_min", ("timeout_min", "time"), executor=("time", "timeout_min")),
    Parameter("account", "the site's account", owned=False, yields=True),
    Parameter("qos", "the site's qos", owned=False, yields=True),
    Parameter("output", "the site's storage.logs"),
    Parameter("error", "the site's storage.logs"),
    Parameter("open-mode", "nothing (hpcdist appends to the logs)"),
    Parameter("signal", "the site's preemption.signal and preemption.seconds_before_end"),
    Parameter("requeue", "nothing (hpcdist jobs requeue on preemption)"),
    Parameter("no-requeue", "resources.spare_nodes (its standby job, not Slurm, runs it on when its batch node dies)"),
    Parameter("no-kill", "resources.spare_nodes (a dead node leaves the allocation, the job stays)"),
    Parameter("array", "`hpcdist submit --sweep`"),
    Parameter("dependency", "--after, or --chain", owned=False),
    Parameter("kill-on-invalid-dep", "--after, or --chain", owned=False),
    Parameter("export", "env_passthrough", owned=False),
)

_BY_OPTION = {p.option: p for p in PARAMETERS}
# Options hpcdist writes itself, and where a job spec sets them instead.
OWNED = {p.option: p.key for p in PARAMETERS if p.owned}


def submitit_names() -> dict[str, str]:
    """submitit's name of each value a job spec key holds, and that key's own name there
    (``timeout_min`` and ``time``: ``time_min``; ``ntasks_per_node``: ``tasks_per_node``)."""
    return {name: p.key.rpartition(".")[2] for p in PARAMETERS for name in p.submitit}


def executor_parameters(values: Mapping[str, object], slurm: bool) -> dict[str, object]:
    """What submitit's executor is given (``update_parameters``): each option's value in
    `values` under submitit's Slurm or local name for it."""
    return {p.executor[0 if slurm else 1]: values[p.option] for p in PARAMETERS if p.executor}


def directives(values: Mapping[str, SbatchValue | None], extra: Mapping[str, SbatchValue], after: Sequence[str] = (),
               export: Sequence[str] = ()) -> tuple[tuple[str, SbatchValue], ...]:
    """The script's #SBATCH options: `values` (option: the value decided for it; None: not
    written) in the table's order, then `extra` (the site's and the job's own ``sbatch:``, the
    job's winning), sorted. A job that waits for the jobs `after` depends on each (``afterok``,
    beside its own dependency) and dies with a failed one instead of pending forever; `export`
    adds the names the job takes from the submitting shell (never values) to the site's
    ``--export``."""
    extra = dict(extra)
    written = {k: v for k, v in values.items() if v is not None and not (k in extra and _BY_OPTION[k].yields)}
    if after:
        written["dependency"] = ",".join([*([str(extra.pop("dependency"))] if "dependency" in extra else []),
                                         *(f"afterok:{j}" for j in after)])
        written["kill-on-invalid-dep"] = extra.pop("kill-on-invalid-dep", "yes")
    if export:  # ALL (Slurm's default) or a list stays as it is plus the names, NONE becomes the names
        listed = str(extra.pop("export", "ALL"))
        written["export"] = ",".join([*([] if listed.upper() == "NONE" else [listed]), *export])
    return (*((p.option, written[p.option]) for p in PARAMETERS if p.option in written), *sorted(extra.items()))


def slurm_time(minutes: float) -> str:
    """Slurm's ``--time`` for `minutes`: whole minutes as they are, a fraction as ``M:SS``
    (submitit's ``timeout_min`` may be ``3 / 60``), never less than a second."""
    if float(minutes).is_integer():
        return str(int(minutes))
    seconds = max(1, round(minutes * 60))
    return f"{seconds // 60}:{seconds % 60:02d}"


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

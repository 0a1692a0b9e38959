"""A job with spare nodes survives the death of its batch node through a standby job queued
behind it (the chain NVIDIA's Resiliency Extension deploys as a job array), not through Slurm's
requeue.

The batch script and the in-job supervisor (``hpcdist.runtime.in_job``) die with the batch node.
Slurm 22.05 takes a dead node out of a ``--no-kill`` job of several nodes, the batch node too,
and leaves the job running with no batch script until its time limit (``kill_on_node_fail == 0``
comes before the batch host's requeue in slurmctld). So the ranks watch: each rank's connection
to the supervisor has TCP keepalives, and a rank whose connection times out asks whether the
batch node is dead (Slurm's word, else its slurmd's silence within a second, as
``rollcall.evidence`` judges) and then cancels the job, naming the node in its folder
(``supervisor_lost``, ``JobPaths.batch_node_died``). The job is submitted ``--no-requeue`` (a
single-node job's batch node death then ends it ``NODE_FAIL``, not in Slurm's requeue and its
two minutes' hold) with a standby job S behind it: the same batch script, its argument the job id
J, ``--dependency=afternotok:J --kill-on-invalid-dep=yes``. Slurm cancels S when J completes,
and starts S about 2 s after J ends in any other way; S may start with fewer spares
(``--nodes=N-(N+spares)``: the dead node is down).

- **Queued** (``queue``) by ``hpcdist submit`` right after J (``hpcdist.login.submit``), and by
  any run that finds none (``main``): a standby that took over queues its own, so the chain goes
  on; a job submitted ``--on HOST`` gets its first one at its start. S's folder gets its own key
  (0600), J's pickled call and script (0600; submitit's files are keyed by job id), and J's
  folder the link ``JobPaths.standby`` (S's id), which ``hpcdist wait``, ``jobs`` and ``cancel``
  follow (``hpcdist.login.standby``).
- **On start** (``main``, the batch script's step before the supervisor), S asks Slurm how J
  ended (``taken_over``). Only a cancel its rank made for the batch node's death, ``NODE_FAIL``
  and ``PREEMPTED`` (Slurm's preemption, which cannot requeue a ``--no-requeue`` job) are taken
  over: the dead nodes go into S's node-failure record and the site's node health record, S's
  folder gets ``JobPaths.took_over`` (J's id), and the ranks resume from the checkpoint on shared
  storage, whose claim passes to S as J has ended (``store.checkpoint.claim``). A J that failed
  by its own code, was cancelled by its user (no node named) or timed out ends S at once with one
  line, nothing run (exit ``ENDS``).
- **hpcdist's own requeues** (preemption, a time limit, no spare left) make J requeueable first
  (``scheduler.slurm.requeue``: ``Requeue=1``); the next run sets it back (``Requeue=0``) so its
  batch node's death ends it again. S waits behind a requeued J.

This is the one case where hpcdist resubmits a job for a node failure: without spares the rule
stays Slurm's requeue (``hpcdist.login.node_failure_wait``). It costs a second queued job per
job with spares, and a standby that starts and ends at once when J fails by its own code.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcdist.config.contract import restart_count
from hpcdist.config.paths import batch_node_died
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.files.atomic import atomic_path
from hpcdist.scheduler import slurm
from hpcdist.scheduler.states import JobState

ENDS = 3  # main's exit status for a standby with nothing to take over: the batch script exits 0
TAKEN_OVER = (JobState.NODE_FAIL, JobState.PREEMPTED, JobState.CANCELLED)  # ends a standby looks into
# what a job queued from inside another job must not inherit: the other job's identity
_INHERITED = ("SLURM_", "SBATCH_", "SALLOC_", "HPCDIST_LAUNCH_TIME")


def _say(line: str) -> None:
    print(f"hpcdist: {line}", file=sys.stderr, flush=True)


def _copy_private(source: Path, target: Path) -> None:
    with atomic_path(target, mode=0o600) as tmp:
        shutil.copyfile(source, tmp)


def read_link(path: Path) -> str | None:
    """The job id a link file (``JobPaths.standby``, ``JobPaths.took_over``) holds; None without one."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text if slurm.is_job_id(text) else None


def queue(spec: JobSpec, site: Site, job_id: str, env: Mapping[str, str] | None = None) -> str:
    """Queue the standby of job `job_id` (its pickled call and script in its submitit folder) and
    link it; its id."""
    from submitit.core.utils import JobPaths as SubmititPaths

    from hpcdist.runtime import signed_store

    res = spec.resources
    paths = spec.paths(site, job_id)
    own = SubmititPaths(paths.folder, job_id=job_id)
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith(_INHERITED)}
    options = (f"--dependency=afternotok:{job_id}", "--kill-on-invalid-dep=yes",
               f"--nodes={res.nodes}-{res.nodes + res.spare_nodes}")
    standby = slurm.sbatch(own.submission_file, options, (job_id,), env)
    folder = spec.paths(site, standby).folder
    folder.mkdir(parents=True, exist_ok=True)
    theirs = SubmititPaths(folder, job_id=standby)
    signed_store.place_key(signed_store.new_key(folder), folder, standby)  # before the pickle the ranks wait for
    _copy_private(own.submission_file, theirs.submission_file)
    _copy_private(own.submitted_pickle, theirs.submitted_pickle)
    with atomic_path(paths.standby, mode=0o600) as tmp:
        tmp.write_text(f"{standby}\n")
    return standby


def verdict(job_id: str) -> tuple[JobState, str]:
    """How job `job_id` ended, as Slurm says (slurmctld's record, else the accounting), and the
    node that ran its batch script ("" when unknown)."""
    info = slurm.show_job(job_id)
    if info is not None and info.state.final:
        return info.state, info.batch_host
    state = slurm.read_state(job_id).state
    return state, info.batch_host if info is not None else ""


def taken_over(spec: JobSpec, site: Site, job_id: str, state: JobState) -> str:
    """Why job `job_id`'s standby runs it on after it ended `state` ("" when it does not): Slurm
    ended it ``NODE_FAIL`` or ``PREEMPTED``, or its rank cancelled it when its batch node died
    (``supervisor_lost``; a user's cancel leaves no such record)."""
    if state is JobState.CANCELLED:
        try:
            said = spec.paths(site, job_id).batch_node_died.read_text().split(maxsplit=1)
        except OSError:
            return ""
        return f"its batch node {said[0]} died, its rank found: {said[1].strip()}" if len(said) == 2 else ""
    return {JobState.NODE_FAIL: "a node died", JobState.PREEMPTED: "it was preempted"}.get(state, "")


def take_over(job_id: str, spec: JobSpec, site: Site, standing_for: str) -> tuple[bool, str]:
    """This run of standby job `job_id` for job `standing_for`: whether it runs the job on, and
    the line that says so."""
    from hpcdist.runtime import node_failure
    from hpcdist.scheduler.hostlist import expand_hostlist
    from hpcdist.scheduler.slurm_cluster import node_states

    state, batch_host = verdict(standing_for)
    why = taken_over(spec, site, standing_for, state)
    if not why:
        how = "has not ended" if not state.final else f"ended {state.value}"
        return False, (f"standby job {job_id} for job {standing_for}: that job {how}, which its standby does not "
                       f"run on (only its batch node's death or a preemption); nothing run")
    info = slurm.show_job(standing_for)
    nodes = expand_hostlist(info.nodes) if info is not None and info.nodes else []
    states = node_states(",".join(nodes)) if nodes else None
    dead = sorted({batch_host} - {""} | {n for n in nodes if states and n in states and states[n].dead})
    if state is JobState.NODE_FAIL and batch_host:
        why = f"its batch node {batch_host} died"
    paths = spec.paths(site, job_id)
    run = info.restarts + 1 if info is not None else 1
    for node in dead:
        said = f"the batch node of job {standing_for}" if node == batch_host else f"down under job {standing_for}"
        for problem in node_failure.record_in_job(standing_for, site, paths, node, said, run):
            _say(f"warning: {problem}")
    with atomic_path(paths.took_over, mode=0o600) as tmp:
        tmp.write_text(f"{standing_for}\n")
    return True, (f"standby job {job_id} takes over job {standing_for}, which ended {state.value}: {why}; its "
                  f"ranks resume from the job's last checkpoint")


def supervisor_lost(folder: str, env: Mapping[str, str]) -> None:
    """In a rank of a job with spares whose connection to its supervisor timed out: when Slurm
    says, or its slurmd's silence shows, that the job's batch node is dead, the job is cancelled,
    the node named in its folder (``JobPaths.batch_node_died``), for its standby to run it on.
    Slurm takes a dead batch node out of a ``--no-kill`` job of several nodes and leaves the job
    running with no batch script (Slurm 22.05's ``kill_on_node_fail == 0`` path), until its time
    limit; every rank that finds it does the same, once each."""
    from submitit.core.utils import JobPaths as SubmititPaths

    from hpcdist.scheduler.slurm_cluster import node_states, slurmd_addresses, slurmd_silent

    job_id = env.get("SLURM_JOB_ID", "")
    try:
        info = slurm.show_job(job_id) if slurm.is_job_id(job_id) else None
        node = info.batch_host if info is not None and not info.state.final else ""
        if not node:
            return
        known = (node_states(node) or {}).get(node)  # Slurm's word, else its slurmd's silence (rollcall.evidence's)
        address = slurmd_addresses([node]).get(node)
        why = f"Slurm says {known.state}" if known is not None and known.failed else \
            slurmd_silent(address, 1.0) if address else ""
        if not why:
            return
        path = batch_node_died(SubmititPaths(folder, job_id=job_id).folder, job_id)
        with atomic_path(path, mode=0o600) as tmp:
            tmp.write_text(f"{node} {why}\n")
        _say(f"the batch node {node} of job {job_id} died ({why}), which Slurm leaves the job running without: "
             f"the job is ended for its standby job to run it on")
        slurm.scancel(job_id)
    except Exception as exc:  # noqa: BLE001 - another rank may have ended it first
        _say(f"warning: after its supervisor's connection timed out, this rank could not end job {job_id}: "
             f"{type(exc).__name__}: {exc}")


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """``python -m hpcdist.runtime.standby FOLDER [JOB]``: the batch script's step before the
    supervisor of a job with spares (JOB: the job this one stands by for). 0: the run goes on;
    ``ENDS``: a standby with nothing to take over; else a standby that could not decide."""
    from hpcdist.runtime.node_failure import submitted

    env = os.environ if env is None else env
    args = list(sys.argv[1:] if argv is None else argv)
    standing_for = args[1] if len(args) > 1 and args[1] else ""
    if not args or (standing_for and not slurm.is_job_id(standing_for)):
        print("usage: python -m hpcdist.runtime.standby FOLDER [JOB]", file=sys.stderr)
        return 2
    os.environ.setdefault(slurm.TIMEOUT_VAR, "10")  # a run waits on this step
    try:
        job_id, spec, site, _, _ = submitted(args[0], env, wait_s=30.0 if standing_for else 5.0)
        if standing_for:
            goes_on, line = take_over(job_id, spec, site, standing_for)
            _say(line)
            if not goes_on:
                return ENDS
    except Exception as exc:  # noqa: BLE001 - one line; a job's own run goes on without a standby
        said = "error" if standing_for else "warning"
        _say(f"{said}: the standby step could not decide: {type(exc).__name__}: {exc}")
        return 1 if standing_for else 0
    try:
        if restart_count(env) > 0:  # requeued by hpcdist (made requeueable for it): a batch node's death ends it again
            slurm.update_job(job_id, Requeue="0")
        linked = read_link(spec.paths(site, job_id).standby)
        if linked is None or slurm.read_state(linked).state.final:  # none yet, or one that ended (cancelled)
            _say(f"standby job {queue(spec, site, job_id, env)} queued behind job {job_id} (it runs the job on "
                 f"if this run's batch node dies)")
    except Exception as exc:  # noqa: BLE001 - a job runs without a standby rather than not at all
        _say(f"warning: no standby job queued behind job {job_id}, so its batch node's death ends it: "
             f"{type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

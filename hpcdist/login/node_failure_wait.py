"""A dead node: the job runs again without it, or ends (``on_node_failure: requeue | fail``).

One path. When a node stops answering, Slurm declares it DOWN after ``SlurmdTimeout`` and, as the
site's ``JobRequeue`` and hpcdist's ``--requeue`` ask, requeues the job under the same id: the
only actor left when the dead node was the head (the batch script, rank 0 and its store) is
Slurm. hpcdist never resubmits a job without spares for a node failure (a job with spares is
submitted ``--no-requeue``, and its batch node's death is caught by the standby job queued
behind it: ``hpcdist.runtime.standby``; its other nodes' by its supervisor). What a failure means (which node died,
the policy, the bound ``preemption.max_requeues``, the records) is decided in one place,
``hpcdist.runtime.node_failure``, for the two that act on it:

- **The waiter** (``submit --wait``, ``hpcdist wait``, ``JobHandle.wait``; this module), while
  Slurm holds the requeued job pending (about two minutes: ``BeginTime``, until the old run's
  job credentials expire), once per failed run. With ``requeue`` the dead node (in the failed
  run's node list and, to Slurm, down or not responding) is added to the pending job's
  ``ExcNodeList``, merged with what it excluded already (the user's ``sbatch: {exclude: ...}``
  among it). A job that resumes at another world size (``resizes``: its kind's, hpcdist
  checkpoints in its directory, or ``resources.min_nodes`` set) that would not find as many live
  nodes as it asked for has its node and task counts lowered (``NumNodes``, ``NumTasks``,
  ``NumCPUs``; its script exports the new task count), never below ``min_nodes`` (1 when unset):
  it runs on the nodes that remain, at a smaller world size; with enough live nodes at its own
  size. A job that could never start without the dead node (more nodes asked than remain to it,
  and it may not shrink that far) is cancelled with one line saying why and what to set.
  Not ``--nodes=MIN-MAX`` at submission: Slurm sizes such a job's tasks by its minimum and may
  start it on the minimum at once. With ``fail``, or past the bound, the pending job is cancelled
  and the waiter says why. A waiter started late (``hpcdist wait`` after the node died) acts the
  same: Slurm's restart count, not having seen the job run, is its evidence.
- **The requeued run itself**, on its head node before any rank starts (the batch script runs
  ``python -m hpcdist.runtime.node_failure`` when ``SLURM_RESTART_COUNT`` is above 0): it records
  the failure and marks the node, and ends the run with one line (``hpcdist: not run again:
  ...``, the job's cause in ``hpcdist wait`` and ``hpcdist jobs``) under ``fail`` or past the
  bound. A run a waiter already handled finds it recorded (the record is keyed by run number).

Either way the failure goes into the job's record beside its result
(``hpcdist.store.records.node_failures``; only when it runs again without the node) and the site's node
health record (``hpcdist.store.records.health``), so later submissions keep off the node.

**Shrinking needs a waiter.** Without one nothing lowers a pending job's node count: the run
cannot start to do it, Slurm has no setting that shrinks a requeued job by itself, and
``--nodes=MIN-MAX`` is not usable (above). A job that may shrink and has no spare live node then waits
in the queue at its own size (measured: ``ReqNodeNotAvail, UnavailableNodes:n3``, Slurm's hold
released) until the node is back or another frees; ``hpcdist wait JOBID`` started at any time
while it waits shrinks it (it ran again 3 s after such a late waiter started). hpcdist starts no daemon
for this: a process left behind on a login node outlives the user's session only where the site
allows it, and a second waiter beside the user's own would act on the job twice.
"""

from __future__ import annotations

import logging
import time

from hpcdist.config.paths import JobPaths
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import HpcdistError
from hpcdist.login.exclusions import user_exclude
from hpcdist.runtime import node_failure
from hpcdist.scheduler import slurm, slurm_cluster
from hpcdist.scheduler.hostlist import expand_hostlist
from hpcdist.scheduler.states import JobState
from hpcdist.store.records import node_failures

log = logging.getLogger("hpcdist")

CHECK_EVERY_S = 2.0  # how often a pending, requeued job is looked at (one scontrol call)


class NodeFailures:
    """One Slurm job watched by its waiter for a requeue after a node failure (``poll`` at every
    state read). ``cause`` says why, once this ended the job."""

    def __init__(self, job_id: str, spec: JobSpec, site: Site, paths: JobPaths) -> None:
        self.job_id, self.spec, self.site = job_id, spec, site
        self.paths = paths
        self.handled = node_failure.handled(paths)
        self.ran = False
        self.late = True  # not seen running yet: Slurm's restart count says whether it ran before
        self.cause = ""
        self.live_seen = ""
        self._checked = float("-inf")

    def poll(self, state: JobState, restarts: str = "") -> None:
        """`restarts`: squeue's count with the state, where the waiter's query had it (saves a
        ``scontrol show job`` per job waited on: a job never started again needs no look)."""
        if state in (JobState.RUNNING, JobState.COMPLETING):
            self.ran = True
            return
        now = time.monotonic()
        if self.late and not self.ran and restarts == "0":
            self.late = False  # pending for its first run: nothing to do until it has run
        if self.cause or not (self.ran or self.late) or state not in (JobState.PENDING, JobState.REQUEUED):
            return
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        try:
            self._check()
        except HpcdistError as exc:  # Slurm could not be asked or updated: try again at the next poll
            log.warning("job %s: could not act on its requeue: %s", self.job_id, exc)

    def _check(self) -> None:
        info = slurm.show_job(self.job_id)
        if info is None:
            return
        if info.restarts == 0:
            self.late = False  # pending for its first run: nothing to do until it has run
            return
        verdict = node_failure.assess(self.job_id, self.spec, self.site, self.handled)
        if verdict is None or not verdict.runs:
            return
        if verdict.stop:
            self._record(verdict)
            return self._end(verdict.stop_line("so Slurm's requeue was cancelled"))
        shrink = ""
        if verdict.found:
            user = expand_hostlist(user_exclude(self.spec, self.site))
            excluded = list(dict.fromkeys([*expand_hostlist(info.excluded), *user, *verdict.nodes]))
            update = {"ExcNodeList": ",".join(excluded)}
            required = expand_hostlist(info.required)
            if set(required) & set(excluded):  # the user's nodelist named the dead node: not any more
                update["ReqNodeList"] = ",".join(n for n in required if n not in excluded)
            nodes, never = self._nodes_left(excluded, required)
            if never:  # no node set left could ever run it at a size it accepts: end it, not wait forever
                self._record(verdict)
                return self._end(f"{verdict.why}; {never}")
            if nodes is not None:
                res = self.spec.resources
                update.update(NumNodes=str(nodes), NumTasks=str(nodes * res.tasks_per_node),
                              NumCPUs=str(nodes * res.tasks_per_node * self.spec.cpus_per_task(self.site)))
                shrink = f", on {nodes} of its {res.nodes} nodes ({self.live_seen})"
            slurm.update_job(self.job_id, **update)
        self._record(verdict)
        self.handled.update(verdict.runs)
        log.warning("job %s: %s; it runs again without it%s", self.job_id, verdict.why, shrink)

    def _nodes_left(self, excluded: list[str], required: list[str]) -> tuple[int | None, str]:
        """(how many nodes the job runs on next, None: no change; why it could never run, or "").

        The nodes it may use are those of its nodelist, when it gave one, else of its partition,
        less the excluded ones; the live ones are those Slurm does not have down, drained or
        failing (busy or not: a spare need not be free). A job that may shrink (its kind resumes at
        another world size, ``resizes``; or it set ``resources.min_nodes``) runs on all it asked
        for while that many are live, else on the live ones, never fewer than ``min_nodes`` (1 by
        default): when the floor is more than it may use at all, it could never run. A job that may
        not shrink could never run when it asked for more nodes than it may use at all; else it
        waits at its own size for a node to come back."""
        res = self.spec.resources
        pname = self.site.partition(res.partition)[0]
        states = (slurm_cluster.node_states(nodes=",".join(required)) if required
                  else slurm_cluster.node_states(partition=pname))
        if states is None:
            return None, ""
        allowed = [n for n in states if n not in excluded]
        usable = [n for n in allowed if not states[n].dead]
        self.live_seen = f"live and not excluded: {', '.join(usable) or 'none'}"
        among = f"its nodelist {','.join(required)}" if required else f"partition {pname!r}"
        if not resizes(self.spec, self.paths):
            if res.nodes <= len(allowed):
                return None, ""
            return None, (f"it asks {res.nodes} nodes and only {len(allowed)} of {among} remain without the "
                          f"excluded ({', '.join(excluded)}), and it cannot resume at another world size (it has no "
                          f"hpcdist checkpoint to resume from): it could never start, so Slurm's requeue was "
                          f"cancelled (resubmit it on fewer nodes, resources.nodes, or once the node is back)")
        floor = res.min_nodes or 1
        if floor > len(allowed):
            return None, (f"it may shrink to resources.min_nodes={floor} nodes and only {len(allowed)} of {among} "
                          f"remain without the excluded ({', '.join(excluded)}): it could never start, so Slurm's "
                          f"requeue was cancelled (set resources.min_nodes to {len(allowed) or 1} or less, or "
                          f"resubmit once the node is back)")
        nodes = max(floor, min(res.nodes, len(usable)))
        return (nodes if nodes < res.nodes else None), ""

    def _record(self, verdict: node_failure.Verdict) -> None:
        for problem in node_failure.record(verdict, self.job_id, self.site, self.paths):
            log.warning("job %s: %s", self.job_id, problem)

    def _end(self, cause: str) -> None:
        self.cause = cause
        slurm.scancel(self.job_id)


def resizes(spec: JobSpec, paths: JobPaths) -> bool:
    """Whether the job may run again on fewer nodes: it set ``resources.min_nodes``, or its kind
    resumes at another world size (train_gpt; a kind whose default is to run again without a dead
    node), or it is a script whose hpcdist checkpoints (``hpcdist.init()``) are in its checkpoint
    directory: they resume at any world size."""
    from hpcdist.kinds.registry import get_kind
    from hpcdist.store.checkpoint.directory import read_commit

    if spec.resources.min_nodes is not None:
        return True
    try:
        if get_kind(spec.kind).on_node_failure == "requeue":
            return True
    except KeyError:
        return False
    return read_commit(paths.checkpoints).path is not None


def describe(paths: JobPaths) -> list[str]:
    """One line per node the job ran again without (for ``submit --wait`` and ``hpcdist jobs``)."""
    return [f.describe() for f in node_failures.read(paths.node_failures)]

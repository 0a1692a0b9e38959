"""A dead node: the job runs again without it, or ends (``on_node_failure: requeue | fail``).

One path. When a node stops answering, Slurm declares it DOWN after ``SlurmdTimeout`` and, as the
site's ``JobRequeue`` and hpcdist's ``--requeue`` ask, requeues the job under the same id: the
only actor left when the dead node was the head (the batch script, rank 0 and its store) is
Slurm. hpcdist never resubmits a job for a node failure. What a failure means (which node died,
the policy, the bound ``preemption.max_requeues``, the records) is decided in one place,
``hpcdist.runtime.node_failure``, for the two that act on it:

- **The waiter** (``submit --wait``, ``hpcdist wait``, ``JobHandle.wait``; this module), while
  Slurm holds the requeued job pending (about two minutes: ``BeginTime``, until the old run's
  job credentials expire), once per failed run. With ``requeue`` the dead node (in the failed
  run's node list and, to Slurm, down or not responding) is added to the pending job's
  ``ExcNodeList``, merged with what it excluded already (the user's ``sbatch: {exclude: ...}``
  among it). A job with ``resources.min_nodes`` that would not find as many live nodes as it
  asked for has its node and task counts lowered (``NumNodes``, ``NumTasks``, ``NumCPUs``; its
  script exports the new task count): it runs on the nodes that remain, at a smaller world size;
  with a spare free, or without ``min_nodes``, at its own size (waiting for a node if need be).
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
(``hpcdist.store.node_failures``; only when it runs again without the node) and the site's node
health record (``hpcdist.store.health``), so later submissions keep off the node.

**Shrinking needs a waiter.** Without one nothing lowers a pending job's node count: the run
cannot start to do it, Slurm has no setting that shrinks a requeued job by itself, and
``--nodes=MIN-MAX`` is not usable (above). A job with ``min_nodes`` and no spare free then waits
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
from hpcdist.scheduler import slurm
from hpcdist.scheduler.hostlist import expand_hostlist
from hpcdist.scheduler.states import JobState
from hpcdist.store import node_failures

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

    def poll(self, state: JobState) -> None:
        if state in (JobState.RUNNING, JobState.COMPLETING):
            self.ran = True
            return
        now = time.monotonic()
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
            nodes = self._nodes_left(excluded, required)
            if nodes is not None:
                res = self.spec.resources
                update.update(NumNodes=str(nodes), NumTasks=str(nodes * res.tasks_per_node),
                              NumCPUs=str(nodes * res.tasks_per_node * res.cpus_per_task))
                shrink = f", on {nodes} of its {res.nodes} nodes ({self.live_seen})"
            slurm.update_job(self.job_id, **update)
        self._record(verdict)
        self.handled.update(verdict.runs)
        log.warning("job %s: %s; it runs again without it%s", self.job_id, verdict.why, shrink)

    def _nodes_left(self, excluded: list[str], required: list[str]) -> int | None:
        """How many nodes the job runs on next when it may shrink (``resources.min_nodes``): all it
        asked for while there are that many live nodes it may use (of its nodelist, when it gave
        one, else of its partition), else those, but never fewer than ``min_nodes`` (it then waits
        for a node to come back). None: no change."""
        res = self.spec.resources
        if res.min_nodes is None:
            return None
        states = slurm.node_states(nodes=",".join(required)) if required else slurm.node_states(
            partition=self.site.partition(res.partition)[0])
        if states is None:
            return None
        usable = [n for n, state in states.items() if not state.dead and n not in excluded]
        self.live_seen = f"live and not excluded: {', '.join(usable) or 'none'}"
        nodes = max(res.min_nodes, min(res.nodes, len(usable)))
        return nodes if nodes < res.nodes else None

    def _record(self, verdict: node_failure.Verdict) -> None:
        for problem in node_failure.record(verdict, self.job_id, self.site, self.paths):
            log.warning("job %s: %s", self.job_id, problem)

    def _end(self, cause: str) -> None:
        self.cause = cause
        slurm.scancel(self.job_id)


def describe(paths: JobPaths) -> list[str]:
    """One line per node the job ran again without (for ``submit --wait`` and ``hpcdist jobs``)."""
    return [f.describe() for f in node_failures.read(paths.node_failures)]

"""What a job's node failures mean, decided in one place for the two that act on them: the
waiter on the login side (``hpcdist.login.node_failure_wait``, while Slurm holds the requeued job pending) and
the requeued run itself on its head node, before any rank starts (``main``, which the batch
script runs when ``SLURM_RESTART_COUNT`` is above 0).

- **What counts**: a run of the job that Slurm's accounting ended ``NODE_FAIL`` (``sacct
  --duplicates``: one record per start), and, of its nodes, those Slurm now says are down,
  drained or failing (``NodeStatus.dead``): sacct names the whole allocation, not the node that
  died. A node that cannot reach slurmdbd (the local cluster's: ``AccountingStorageHost`` is
  localhost; some sites' compute nodes) reads the earlier runs from the line the batch script
  writes at each start into its output (``runs_from_output``): there a run with a node that has
  failed now (down, not responding; not merely drained) counts, unless the run asked for its own
  requeue (a preemption, ``ctx.requeue()``; ``JobPaths.requeues``). A run is handled once: the
  job's record (``hpcdist.store.records.node_failures``) is keyed by run number, so a waiter and the run
  that both see the same failure record it once.
- **The policy and the bound**: the spec's ``on_node_failure`` (``fail`` ends the job; a spec that
  names none gets its kind's default from ``hpcdist.kinds.registry``, the runtime's one import of
  the kinds beside ``entry``'s), and no more
  node-failure restarts than the site's ``preemption.max_requeues``.
- **The record**: the dead nodes go into the site's node health record (``hpcdist.store.records.health``)
  whatever the verdict, so later submissions keep off them; into the job's own record only when
  the job goes on without them (``NodeFailure``: "excluded").

A job with spare nodes goes on in its own allocation (``hpcdist.runtime.in_job``, under
``--no-kill``): its supervisor records each dead node here (``record_in_job``), and once no spare
is left and the job may not shrink, this module's policy and bound decide between Slurm's
requeue and the end (``no_spare_left``). Its batch node's death is its standby job's to catch
(``hpcdist.runtime.standby``); the standby records that node here too (``record_in_job``).

Without a waiter nobody can exclude the node from the pending job or lower its node count:
Slurm's requeue starts it on nodes that are not DOWN, at its own size, and this run's start
records, marks and bounds it, or ends the run (``on_node_failure: fail``, or past the bound) with
one line in the batch log (the log of rank 0), which the post-mortem reads back as the job's
cause (``hpcdist.config.contract.STOPPED``). Runs only on a Slurm site; a run that cannot
ask Slurm goes on (the check never stops a job on a failure of its own).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcdist.config.contract import STOPPED, array_task_id
from hpcdist.config.paths import JobPaths
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import HpcdistError
from hpcdist.scheduler import slurm, slurm_cluster
from hpcdist.scheduler.hostlist import expand_hostlist
from hpcdist.store.records import node_failures
from hpcdist.store.records.node_failures import NodeFailure

STOP_EXIT = 3  # the check's exit status when the run must end: the batch script exits with it
ACCOUNTING_WAIT_S = 10.0  # how long a requeued run waits for accounting to show its earlier runs


@dataclass(frozen=True)
class Verdict:
    """The job's node failures not handled yet, and whether it may run again after them."""

    runs: tuple[int, ...]  # the runs (1: the first) that ended NODE_FAIL and were not handled
    found: tuple[NodeFailure, ...]  # their dead nodes (none: every node answers again)
    why: str  # "node n3 died (run 1 ended NODE_FAIL at 2026-11-24T05:59:01)"
    stop: str = ""  # "" when the job may run again, else why not ("on_node_failure is fail")
    hint: str = ""  # what the user can do about the stop

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(f.node for f in self.found))

    def stop_line(self, then: str) -> str:
        """The one line of a job that does not run again: what died, when, and why it stops;
        `then` says what was done (``so Slurm's requeue was cancelled``)."""
        return f"{self.why}; {self.stop}, {then} ({self.hint})"


def policy(spec: JobSpec) -> str:
    """``requeue`` or ``fail``: the spec's ``on_node_failure``, else its kind's default."""
    from hpcdist.kinds.registry import on_node_failure

    return on_node_failure(spec)


def handled(paths: JobPaths) -> set[int]:
    """The runs whose node failures the job's record already holds."""
    return {f.run for f in node_failures.read(paths.node_failures)}


RUN_LINE = re.compile(r"^hpcdist: run (\d+) on (\S+) at (\S+)$")  # the batch script's line at each run's start


def runs_from_output(text: str, restarts: int, requeued_at: str = "",
                     requeued: Collection[int] = ()) -> list[slurm.Attempt] | None:
    """The job's earlier runs as its batch output tells them (``RUN_LINE``, one per start), for a
    node that cannot read Slurm's accounting: a run counts as ended by a node failure when a node
    it ran on has failed now (down, failing or not responding: Slurm's requeue put the job back
    in the queue), unless the run asked for its own requeue (`requeued`: ``JobPaths.requeues``,
    a preemption or ``ctx.requeue()``). A node drained (maintenance) is no evidence of a death: such
    a run goes on and nothing is marked. Each run ended when the next started, the last one at
    `requeued_at` (slurmctld's SubmitTime of a requeued job) where known. None: no line for one
    of the `restarts` earlier runs, or Slurm's node states unknown."""
    starts: dict[int, tuple[str, str]] = {}
    for line in text.splitlines():
        match = RUN_LINE.match(line.strip())
        if match:
            starts[int(match.group(1))] = (match.group(2), match.group(3))
    if any(n not in starts for n in range(1, restarts + 1)):
        return None
    states = slurm_cluster.node_states()
    if states is None:
        return None
    out = []
    for n in range(1, restarts + 1):
        nodes, _ = starts[n]
        end = (requeued_at if n == restarts else "") or (starts[n + 1][1] if n + 1 in starts else "unknown")
        dead = n not in requeued and any(states[h].failed for h in expand_hostlist(nodes) if h in states)
        out.append(slurm.Attempt("NODE_FAIL" if dead else "REQUEUED", nodes, end))
    return out


def assess(job_id: str, spec: JobSpec, site: Site, done: set[int], restarts: int = 0,
           output: Path | None = None, requeued: Collection[int] = ()) -> Verdict | None:
    """The verdict on job `job_id`'s NODE_FAIL runs not in `done`; an empty one (no ``runs``) when
    there are none, None when Slurm could not be asked (unknown: ask again later). `restarts`:
    how often Slurm has requeued the job; accounting that does not list as many earlier runs yet
    is read again for up to ``ACCOUNTING_WAIT_S`` (slurmdbd records a job's end a moment late).
    Where accounting cannot be read at all, the job's batch `output` tells its runs
    (``runs_from_output``, with the runs that asked for their own requeue: `requeued`)."""
    deadline = time.monotonic() + ACCOUNTING_WAIT_S
    while True:
        runs = slurm.attempts(job_id)
        if runs is None:
            runs = _runs_from_file(job_id, output, restarts, requeued) if output is not None and restarts else None
            if runs is None:
                return None
            break
        ended = [r for r in runs if r.state not in ("RUNNING", "PENDING")]  # REQUEUED ended a run
        if len(ended) >= restarts or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    failed = [(n, run) for n, run in enumerate(runs, 1) if run.state == "NODE_FAIL"]
    new = [(n, run) for n, run in failed if n not in done]
    if not new:
        return Verdict((), (), "")
    found: list[NodeFailure] = []
    for n, run in new:
        states = slurm_cluster.node_states(run.nodes)
        if states is None:
            return None
        found += [NodeFailure(node, run.end, n, time.time()) for node in sorted(k for k, v in states.items() if v.dead)]
    names = ", ".join(dict.fromkeys(f.node for f in found))
    runs_said = ", ".join(f"run {n} ended NODE_FAIL at {run.end}" for n, run in new)
    why = f"node {names} died ({runs_said})" if names else f"a node died ({runs_said}; every node of it answers again)"
    limit = site.preemption.max_requeues
    stop = hint = ""
    if policy(spec) == "fail":
        stop, hint = "on_node_failure is fail", "set on_node_failure: requeue to run again without it"
    elif len(failed) > limit:
        stop = f"{len(failed)} node failures of this job, more than the site's preemption.max_requeues={limit}"
        hint = "resubmit the same spec to resume from its last checkpoint"
    return Verdict(tuple(n for n, _ in new), tuple(found), why, stop, hint)


def _runs_from_file(job_id: str, output: Path, restarts: int, requeued: Collection[int]) -> list[slurm.Attempt] | None:
    try:
        text = output.read_text(errors="replace")
    except OSError:
        return None
    info = slurm.show_job(job_id)
    return runs_from_output(text, restarts, info.submitted if info is not None else "", requeued)


def record(verdict: Verdict, job_id: str, site: Site, paths: JobPaths) -> list[str]:
    """The verdict's dead nodes into the site's health record, and, when the job goes on without
    them, into the job's own record; a warning per write that failed (the caller logs them)."""
    from hpcdist.store.records import health

    problems = []
    if verdict.found and not verdict.stop:
        try:
            node_failures.add(paths.node_failures, list(verdict.found))
        except OSError as exc:
            problems.append(f"could not write the job's node failure record {paths.node_failures}: {exc}")
    for f in verdict.found:
        try:
            health.mark(site, f.node, f"died under job {job_id} (run {f.run} ended NODE_FAIL at {f.when})",
                        job_id, source="node_failure")
        except (OSError, HpcdistError) as exc:
            problems.append(f"could not mark {f.node} in the node health record: {exc}")
    return problems


# ---------------------------------------------------------------- a job with spare nodes


def record_in_job(job_id: str, site: Site, paths: JobPaths, node: str, why: str, run: int) -> list[str]:
    """A node that died under a job's in-job supervisor (``hpcdist.runtime.in_job``), which goes
    on without it: the job's record and the site's node health record; a warning per write that
    failed."""
    from hpcdist.store.records import health

    problems = []
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        node_failures.add(paths.node_failures, [NodeFailure(node, when, run, time.time())])
    except OSError as exc:
        problems.append(f"could not write the job's node failure record {paths.node_failures}: {exc}")
    try:
        health.mark(site, node, f"died under job {job_id} ({why}; found by its in-job supervisor)", job_id,
                    source="node_failure")
    except (OSError, HpcdistError) as exc:
        problems.append(f"could not mark {node} in the node health record: {exc}")
    return problems


def no_spare_left(job_id: str, spec: JobSpec, site: Site, paths: JobPaths, line: str, run: int) -> str:
    """A job with spares whose node failures left it no live spare, and that may not shrink so far
    (`line` says so): Slurm's requeue, as without spares, under ``on_node_failure: requeue`` and
    within ``preemption.max_requeues`` runs with node failures ("" once requeued); else the line
    the job ends with."""
    from hpcdist.runtime.requeue import record_requeue

    runs, limit = len(handled(paths)), site.preemption.max_requeues
    if policy(spec) == "fail":
        why = "on_node_failure is fail, so the job ends (set on_node_failure: requeue to run it again)"
    elif runs > limit:
        why = (f"node failures in {runs} runs, more than the site's preemption.max_requeues={limit}, so the job "
               f"ends (resubmit the same spec to resume)")
    else:
        record_requeue(paths.requeues, run, "its supervisor, after node failures left no spare")
        try:
            slurm.requeue(job_id)
            return ""
        except HpcdistError as exc:
            why = f"the requeue failed ({exc}), so the job ends (resubmit the same spec to resume)"
    return f"{line}; {why} (or ask for more resources.spare_nodes, or set resources.min_nodes)"


# ---------------------------------------------------------------- the requeued run's own start


def check_run(job_id: str, spec: JobSpec, site: Site, restarts: int, folder: Path | None = None,
              output: Path | None = None) -> str:
    """This run of job `job_id` (Slurm's `restarts`-th requeue) after its node failures: records
    and marks them; the line to end the run with, or "" when it goes on (or nothing is known).
    `output`: the job's batch output, read where accounting cannot be."""
    from hpcdist.runtime.requeue import requeued_runs

    paths = spec.paths(site, job_id)
    verdict = assess(job_id, spec, site, handled(paths), restarts, output, requeued_runs(paths.requeues))
    if verdict is None or not verdict.runs:
        return ""
    for problem in record(verdict, job_id, site, paths):
        _say(f"warning: {problem}")
    if not verdict.stop:
        _say(f"job {job_id}: {verdict.why}; this run goes on without it (restart {restarts})")
        return ""
    if folder is not None:  # the results the ranks of the failed run left are not this run's
        for stale in folder.glob(f"{job_id}_*_result.pkl"):
            stale.unlink(missing_ok=True)
    return verdict.stop_line("so this run ends before its ranks start")


def _say(line: str) -> None:
    print(f"hpcdist: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """``python -m hpcdist.runtime.node_failure FOLDER``: the batch script's step before the launch
    of a requeued run (FOLDER is submitit's, where the job's pickle holds its spec and site).
    Exits ``STOP_EXIT`` when the run must end, 0 otherwise, a failure of its own included."""
    from hpcdist.config.contract import restart_count

    env = os.environ if env is None else env
    args = sys.argv[1:] if argv is None else argv
    restarts = restart_count(env)
    if restarts == 0 or len(args) != 1:
        return 0
    try:
        job_id, spec, site, folder, output = submitted(args[0], env)
        if site.scheduler != "slurm":
            return 0
        # a run waits on this check: one short try a command (a node may not reach slurmdbd at all)
        os.environ.setdefault(slurm.TRIES_VAR, "1")
        os.environ.setdefault(slurm.TIMEOUT_VAR, "10")
        line = check_run(job_id, spec, site, restarts, folder, output)
    except Exception as exc:  # noqa: BLE001 - the check must never be what stops a job
        _say(f"warning: the node failure check of this requeued run could not decide, the run goes on: "
             f"{type(exc).__name__}: {exc}")
        return 0
    if not line:
        return 0
    print(STOPPED + line, file=sys.stderr, flush=True)
    return STOP_EXIT


def submitted(folder: str, env: Mapping[str, str], wait_s: float = 0.0) -> tuple[str, JobSpec, Site, Path, Path]:
    """The job's id, spec and site, as submitit's pickle gives them to its ranks (waiting up to
    `wait_s` for it to appear: submitit moves it into place just after sbatch); its folder and
    batch output (rank 0's stdout)."""
    from submitit.core.utils import JobPaths as SubmititPaths

    job_id = array_task_id(env) or env["SLURM_JOB_ID"]
    paths = SubmititPaths(folder, job_id=job_id)
    deadline = time.monotonic() + wait_s
    while not paths.submitted_pickle.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    from hpcdist.files.trust import load_pickle

    delayed = load_pickle(paths.submitted_pickle)  # unpickled only when no one else could have written it
    spec, site = delayed.args[:2]
    return job_id, spec, site, paths.folder, SubmititPaths(folder, job_id=job_id, task_id=0).stdout


if __name__ == "__main__":
    sys.exit(main())

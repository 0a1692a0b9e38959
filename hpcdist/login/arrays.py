"""A job array that fits the cluster's limits: what ``map_array``, ``submit_array`` and ``hpcdist
submit --sweep`` submit (issue 67, item 3; submitit's issues 1624 and 1659).

Slurm refuses an array whose task indices reach ``MaxArraySize`` (1001 by default) and one that
would put the user over her QOS's ``MaxSubmitJobsPerUser``, each with one terse sbatch line. Here
such an array goes in as several arrays, each indexed from 0 and of at most ``MaxArraySize``
tasks, as many at once as the QOS takes beside her jobs queued and running now; the rest are held
back and submitted as earlier ones end (her queue read with backoff, 5 s to a minute apart), with
one line on stderr saying so; with ``max_parallel`` (the array's ``%N``) a part goes in once the
parts before it ended, so no more than N run at once. The submitting call returns once every
part is in: the handles are all real jobs. ``MaxJobsPerUser`` refuses nothing (Slurm holds the
tasks pending), so it holds nothing back here. The limits are discovery's (``hpcdist.config.discovered``), the queue is
``squeue -u`` (``hpcdist.scheduler.slurm_cluster.my_jobs``).

A direct call's tasks read their spec by their index (``%a`` in ``HPCDIST_CALL_JOB``): a part
after the first is given names of its own, hard links to the files of its tasks.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.contract import CALL_JOB_VAR
from hpcdist.errors import HpcdistError, SubmitError

if TYPE_CHECKING:
    from hpcdist.config.spec import JobSpec
    from hpcdist.login.plan import Plan
    from hpcdist.scheduler.slurm_now import QueuedJob
    from hpcdist.scheduler.slurm_text import Cluster

HOLD_VAR = "HPCDIST_HOLD_TIMEOUT_S"  # how long held tasks may wait for room (default a day)
FIRST_S, MOST_S = 5.0, 60.0  # the queue is read again this long after, growing by half each time


def schedule_parts(plan: Plan, calls: Sequence[Any] | None,
                   schedule: Callable[[Plan, Sequence[Any] | None], list[Any]]) -> list[Any] | None:
    """The array of `plan` submitted in parts that fit (each through `schedule`), its tasks' handles
    in order; None where it goes in whole (it fits, or the cluster's limits are unknown)."""
    from hpcdist.login.limits import Ask, room

    facts = _facts()
    if facts is None:
        return None
    total, size, ask = len(plan.tasks), facts.max_array_size, Ask.of(plan.directives)
    free, words = room(facts, ask, [])  # None: no QOS of hers limits what she submits
    if free is not None:
        free, words = room(facts, ask, _queue(facts, wait=False))
    if total <= size and (free is None or free >= total):
        return None
    name = plan.base.name
    if total > size:
        parts = -(-total // size)
        _say(f"job array {name!r} of {total} tasks goes in as {parts} arrays of at most {size} tasks: the cluster's "
             f"MaxArraySize={size} (scontrol show config)")
    subs: list[Any] = []  # hpcdist.login.submit's Submissions (not imported: it imports this)
    held_said = False
    deadline = time.monotonic() + float(os.environ.get(HOLD_VAR) or 86400.0)
    wait = FIRST_S
    while len(subs) < total:
        take = min(size, total - len(subs))
        if free is not None:
            if free <= 0:
                if not held_said:
                    _say(f"job array {name!r}: {total - len(subs)} of its {total} tasks held back: {words}; they are "
                         f"submitted as earlier ones end")
                    held_said = True
                if time.monotonic() + wait > deadline:
                    raise SubmitError(f"job array {name!r}: {total - len(subs)} of its {total} tasks were still held "
                                      f"back after {os.environ.get(HOLD_VAR) or 86400} s ({words}); the "
                                      f"{len(subs)} submitted run on; set {HOLD_VAR} to wait longer")
                time.sleep(wait)
                wait = min(MOST_S, wait * 1.5)
                free, words = room(facts, ask, _queue(facts, wait=True))
                continue
            take, wait = min(take, free), FIRST_S
        first = len(subs)
        if first and plan.origin.max_parallel:  # its %N holds across parts: the next goes in once these ended
            _wait_for_end(facts, {s.job_id.split("_")[0] for s in subs}, deadline)
        subs += schedule(_part(plan, first, take), None if calls is None else calls[first:first + take])
        if held_said:
            _say(f"job array {name!r}: tasks {first}-{first + take - 1} submitted as job array "
                 f"{subs[-1].job_id.split('_')[0]}")
        if free is not None and len(subs) < total:
            free, words = room(facts, ask, _queue(facts, wait=True))
    return subs


def _say(line: str) -> None:
    print(f"hpcdist: {line}", file=sys.stderr, flush=True)


def _facts() -> Cluster | None:
    """The cluster's limits as discovery read them (no question to the controller when current)."""
    from hpcdist.config.discovered import cached_cluster, discovered_site

    try:
        return cached_cluster(discovered_site())
    except (HpcdistError, OSError):
        return None


def _wait_for_end(facts: Cluster, arrays: set[str], deadline: float) -> None:
    """Until none of the tasks of `arrays` is queued or running."""
    wait = FIRST_S
    while any(j.job_id.split("_")[0] in arrays for j in _queue(facts, wait=True)):
        if time.monotonic() + wait > deadline:
            raise SubmitError(f"job arrays {', '.join(sorted(arrays))} still ran at the hold's end; set {HOLD_VAR} "
                              f"to wait longer for the parts after them")
        time.sleep(wait)
        wait = min(MOST_S, wait * 1.5)


def _queue(facts: Cluster, wait: bool) -> list[QueuedJob]:
    """Her jobs queued and running now, one per array task; read again until squeue answers."""
    from hpcdist.scheduler.slurm_cluster import my_jobs

    delay = FIRST_S
    while True:
        jobs = my_jobs(facts.user)
        if jobs is not None:
            return jobs
        if not wait:
            return []  # unknown now: sbatch has the last word on the first part
        time.sleep(delay)
        delay = min(MOST_S, delay * 1.5)


def _part(plan: Plan, first: int, count: int) -> Plan:
    """The plan of tasks `first` to `first + count - 1`, an array of its own indexed from 0."""
    from hpcdist.login.plan import make

    base, tasks = plan.base, list(plan.tasks[first:first + count])
    if first:
        base, tasks = _own_files(base, first, count), [_own_files(t, first, count) for t in tasks]
    return make(base, plan.site, replace(plan.origin, part=(first, count)), tasks)


def _own_files(spec: JobSpec, first: int, count: int) -> JobSpec:
    """`spec` whose ``%a`` call files are its part's own: links named ``STEM-at<first>-<i>.json``."""
    pattern = spec.env.get(CALL_JOB_VAR, "")
    if "%a" not in pattern:
        return spec
    own = pattern.replace("%a", f"at{first}-%a")
    for i in range(count):
        link = Path(own.replace("%a", str(i)))
        if not link.exists():
            os.link(pattern.replace("%a", str(first + i)), link)
    return spec.model_copy(update={"env": {**spec.env, CALL_JOB_VAR: own}})

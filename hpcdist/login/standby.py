"""The login side of a job's standby (``hpcdist.runtime.standby``): queued at submission, followed
by every front door.

``hpcdist submit`` queues the standby right after the job (``queue_first``). A waiter (``submit
--wait``, ``hpcdist wait``, ``JobHandle.wait`` and ``result()``: ``hpcdist.login.watch``) that
sees the job end so that its standby runs it on (``successor``: its batch node died, or it was
preempted) goes on waiting for the standby: its state, its ranks' results and logs are the job's
from then on, and the job index gets the standby's record (``standby_record``), ``took_over``
naming the job. ``hpcdist logs`` shows each run (``runs``), ``hpcdist cancel`` cancels the job
and every standby behind it (``cancel_chain``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import replace

from hpcdist.config.paths import log_patterns
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.login import jobindex, remote
from hpcdist.runtime.standby import queue, read_link, taken_over
from hpcdist.scheduler.states import JobState

MAX_LINKS = 1000  # a chain is followed no further (links are files a user could loop)


def queue_first(spec: JobSpec, site: Site, job_id: str, array: bool) -> str:
    """The standby of a job with spares just submitted (not in an array, not ``--on HOST``: that
    job's run queues its own at its start); its id, or "" for none. A failure is a warning: the
    job is queued, and its first run tries again."""
    if site.scheduler != "slurm" or not spec.resources.spare_nodes or array or remote.active():
        return ""
    try:
        return queue(spec, site, job_id)
    except Exception as exc:  # noqa: BLE001 - the job is queued; its own run queues one at its start
        print(f"hpcdist: warning: no standby job queued behind job {job_id} ({type(exc).__name__}: {exc}); its first "
              f"run queues one as it starts", file=sys.stderr)
        return ""


def chain(spec: JobSpec, site: Site, job_id: str) -> list[str]:
    """Job `job_id` and the standbys queued behind it, each behind the one before, in order."""
    ids = [job_id]
    while len(ids) < MAX_LINKS and (after := read_link(spec.paths(site, ids[-1]).standby)) and after not in ids:
        ids.append(after)
    return ids


def successor(spec: JobSpec, site: Site, job_id: str, state: JobState) -> tuple[str, str] | None:
    """The standby that runs job `job_id` on after it ended `state`, and why it does; None when
    its run ends there."""
    if site.scheduler != "slurm" or not spec.resources.spare_nodes or not state.final:
        return None
    why = taken_over(spec, site, job_id, state)
    standby = read_link(spec.paths(site, job_id).standby) if why else None
    return (standby, why) if standby else None


def cancel_chain(spec: JobSpec, site: Site, record: jobindex.JobRecord) -> str:
    """``hpcdist cancel`` of a job with spares: the job and every standby behind it that has not ended."""
    from hpcdist.scheduler import slurm, slurm_watch

    ids = chain(spec, site, record.job_id)
    readings = slurm_watch.Watcher().readings(ids)
    live = [i for i in ids if not readings[i].state.final]
    for job_id in live:
        slurm.scancel(job_id)
    head, first = f"job {record.job_id} ({record.name})", readings[record.job_id].state
    if not live:
        return f"{head} already ended: {first.value}; nothing to cancel"
    standbys = [i for i in live if i != record.job_id]
    named = f"standby job{'s' if len(standbys) > 1 else ''} {', '.join(standbys)}"
    if record.job_id not in live:
        return f"{head} ended {first.value}; cancelled its {named}, which ran it on"
    return f"cancelled {head} on site {record.site}" + (f" and its {named}" if standbys else "")


def runs(record: jobindex.JobRecord, spec: JobSpec, site: Site,
         following: bool = False) -> Iterator[jobindex.JobRecord]:
    """The job's record, then one per standby that took its run over, in order (``hpcdist logs``);
    each next one decided once the caller is done with the one before (`following`: it followed it
    to its end, so the standby about to take over counts before it says so)."""
    from hpcdist.scheduler import slurm

    yield record
    if site.scheduler != "slurm" or not spec.resources.spare_nodes:
        return
    current, seen = record, {record.job_id}
    while len(seen) < MAX_LINKS:
        after = read_link(spec.paths(site, current.job_id).standby)
        if after is None or after in seen:
            return
        took = read_link(spec.paths(site, after).took_over) == current.job_id
        if not took and not (following and taken_over(spec, site, current.job_id,
                                                      slurm.read_state(current.job_id).state)):
            return
        current = standby_record(current, spec, site, after)
        seen.add(after)
        yield current


def standby_record(record: jobindex.JobRecord, spec: JobSpec, site: Site, standby: str) -> jobindex.JobRecord:
    """The index's record of standby job `standby`, which runs on the job of `record`."""
    paths = spec.paths(site, standby)
    folder = paths.folder.absolute()
    out, err = (p.replace("%j", standby) for p in log_patterns(folder))
    return replace(record, job_id=standby, folder=str(folder), stdout=out, stderr=err,
                   result=str(paths.result().absolute()), submitted=time.time(), ended=None, cancelled=None,
                   took_over=record.job_id)


def continued_in(record: jobindex.JobRecord) -> str:
    """The last standby that took the job's run over, as ``hpcdist jobs`` names it beside the
    job's own state ("" for none, or a job without spares)."""
    if record.scheduler != "slurm" or not record.spec.get("resources", {}).get("spare_nodes"):
        return ""
    try:
        spec, site = JobSpec.model_validate(record.spec), Site.model_validate(record.site_model)
    except ValueError:  # a record another hpcdist version wrote
        return ""
    ids, last = chain(spec, site, record.job_id), ""
    for before, after in zip(ids, ids[1:], strict=False):
        if read_link(spec.paths(site, after).took_over) != before:
            break
        last = after
    return last

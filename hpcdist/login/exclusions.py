"""The login side of the site's node health record: which nodes a submission keeps away from,
and why (the record on top of the job's own ``sbatch: {exclude: ...}``), and the marks a failed
job's post-mortem adds (``mark_failed_nodes``: Slurm's NODE_FAIL).

``plan.make`` asks ``for_job`` once per plan, so ``hpcdist render`` shows exactly the
``--exclude`` that ``submit`` submits, with a comment line per node saying why. The user's own
exclude list is kept as written and the marked nodes are added to it (merged, never replaced); a
node the job names in its own ``nodelist`` is not excluded (Slurm would refuse the job), and the
script says so. Excluding is refused, in one line naming the marks and ``hpcdist nodes --clear``,
when it would leave the partition fewer nodes than the job asks for: a record that keeps every
job pending forever would be worse than none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcdist.errors import ConfigError, HpcdistError, SubmitError

if TYPE_CHECKING:
    from hpcdist.config.site import Partition, Site
    from hpcdist.config.spec import JobSpec
    from hpcdist.login.postmortem import StepRecord
    from hpcdist.store.records.health import Mark


@dataclass(frozen=True)
class Exclusions:
    """The nodes a job is kept from: the marks that add to ``--exclude``, the marks the job's own
    nodelist overrides, and the user's own exclude value (as written)."""

    marked: tuple[Mark, ...] = ()
    overridden: tuple[Mark, ...] = ()
    user: str = ""
    within_h: float = 0.0

    def flag(self) -> str | None:
        """``--exclude``'s value: the user's list, then each marked node it does not already hold."""
        listed = set(_hosts(self.user, "sbatch.exclude")) if self.user else set()
        added = [m.node for m in self.marked if m.node not in listed]
        value = ",".join([*([self.user] if self.user else []), *added])
        return value or None

    def lines(self) -> list[str]:
        """One line per node the record had something to say about (the script's comments and
        the submit output)."""
        hours = f"{self.within_h:g} h"
        return ([f"excluded {m.describe()} (marked bad within the site's health.exclude_for_h={hours}; "
                 f"`hpcdist nodes --clear {m.node}` forgets it)" for m in self.marked]
                + [f"not excluded, named in the job's nodelist: {m.describe()}" for m in self.overridden])


def _hosts(text: str, key: str) -> list[str]:
    from hpcdist.scheduler.hostlist import expand_hostlist  # pure; only a job with an exclude or a mark needs it

    try:
        return expand_hostlist(text)
    except ValueError as exc:
        raise ConfigError(f"{key}={text!r} is not a Slurm host list ({exc}); write e.g. n3 or n[3-4],gpu07") from exc


def user_exclude(spec: JobSpec, site: Site) -> str:
    """The job's (or the site's) own ``sbatch: {exclude: ...}``, as written ("" when none)."""
    return str({**site.sbatch, **spec.sbatch}.get("exclude", "") or "")


def for_job(spec: JobSpec, site: Site, name: str, partition: Partition) -> Exclusions:
    """The exclusions of `spec` on a Slurm `site`, in its partition `name` (`partition`): its own
    ``exclude`` plus the nodes marked bad within ``health.exclude_for_h``; a SubmitError when
    they leave too few nodes for the job."""
    if site.scheduler != "slurm":
        return Exclusions()
    extra = {**site.sbatch, **{k: str(v) for k, v in spec.sbatch.items()}}
    user = user_exclude(spec, site)
    within_h = site.health.exclude_for_h
    if within_h <= 0:
        return Exclusions(user=user)
    from hpcdist.store.records import health

    marks = health.bad_nodes(site, within_h * 3600.0)
    if not marks:
        return Exclusions(user=user, within_h=within_h)
    pinned = set(_hosts(str(extra["nodelist"]), "sbatch.nodelist")) if "nodelist" in extra else set()
    found = Exclusions(tuple(m for m in marks if m.node not in pinned), tuple(m for m in marks if m.node in pinned),
                       user, within_h)
    _check_enough(found, spec, name, partition)
    return found


def _check_enough(found: Exclusions, spec: JobSpec, name: str, partition: Partition) -> None:
    """Refuse exclusions that leave the job's partition fewer nodes than it asks for (the
    partition's nodes from sinfo; where sinfo cannot be asked, the site's count, every excluded
    node counted as one of them)."""
    if not found.marked:
        return
    from hpcdist.scheduler.slurm_cluster import node_states

    excluded = set(_hosts(found.flag() or "", "sbatch.exclude"))
    states = node_states()
    members = [n for n, s in (states or {}).items() if name in s.partitions]
    if members:
        total, left = len(members), len(set(members) - excluded)
    else:
        total = partition.nodes
        left = total - len(excluded)
    res = spec.resources
    wanted = res.nodes + res.spare_nodes  # Slurm holds the spares too
    if left >= wanted:
        return
    marks = "; ".join(m.describe() for m in found.marked)
    job = f"{res.nodes} nodes + {res.spare_nodes} spare" if res.spare_nodes else f"{wanted}"
    fewer = (f"set resources.spare_nodes={max(left - res.nodes, 0)} (fewer spares), "
             if res.spare_nodes and left >= res.nodes else "")
    raise SubmitError(
        f"excluding the nodes marked bad would leave {max(left, 0)} of partition {name}'s {total} nodes for a job "
        f"of {job}: {marks}; {fewer}if a node is fine again run `hpcdist nodes --clear NODE` (or `--clear all`), "
        f"or set site health.exclude_for_h=0 to submit without the record"
    )


def mark_failed_nodes(site: Site, job_id: str, records: list[StepRecord]) -> str:
    """Slurm ended the job with NODE_FAIL: mark the nodes of its allocation that Slurm now says
    are not responding or down in the site's health record (once per job); what was marked, for
    the failure summary ("" when nothing was). sacct names the whole allocation, so a node that
    came back before this read is not marked: which one died is no longer known."""
    from hpcdist.login.postmortem import node_failure_suspects
    from hpcdist.scheduler.slurm_cluster import node_states
    from hpcdist.store.records import health

    suspects = node_failure_suspects(records)
    states = node_states() if suspects else None
    dead = [states[n] for n in suspects if states and n in states and states[n].failed]
    marked = []
    for node in dead:
        why = f"Slurm ended job {job_id} with NODE_FAIL; the node was {node.state}" + (
            f" ({node.reason})" if node.reason else "")
        try:
            health.mark(site, node.node, why, job_id=job_id, source="node_failure")
            marked.append(node.node)
        except (OSError, HpcdistError) as exc:
            return f"could not mark {node.node} in the site's node health record: {exc}"
    return (f"marked {', '.join(marked)} bad in the site's node health record: later submissions exclude "
            f"{'them' if len(marked) > 1 else 'it'} (`hpcdist nodes`)") if marked else ""

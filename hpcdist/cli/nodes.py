"""``hpcdist nodes``: the site's node health record beside Slurm's own word on each node.

Lists every node the record marks (its newest mark, how many, and whether later submissions
exclude it: a mark younger than the site's ``health.exclude_for_h``), with the state and reason
sinfo gives (``down*``, ``drained``, ``Not responding``), and the nodes Slurm itself gives a
reason for; ``--json`` for scripts. ``--clear NODE`` (or ``--clear all``) forgets marks (one's
own removed; another member's overridden by a newer clear mark of one's own, as the record's
rule is), and ``--mark NODE --reason TEXT`` adds one by hand (source ``user``). The record is
``hpcdist.store.records.health``; Slurm is asked through ``hpcdist.scheduler.slurm``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hpcdist.errors import ConfigError


def add_parser(subs: Any) -> None:
    p = subs.add_parser("nodes", help="nodes the site's health record marks bad, beside Slurm's node states")
    p.add_argument("--site", default=None, help="site name or YAML (default: $HPCDIST_SITE or local)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="site.KEY=VALUE",
                   help="override a site config value (e.g. site.storage.scratch=/path)")
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--clear", metavar="NODE", default=None, help="forget a node's marks ('all': every mark)")
    act.add_argument("--mark", metavar="NODE", default=None, help="mark a node bad by hand (with --reason)")
    p.add_argument("--reason", default="", help="why, with --mark")


def _iso(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def cmd_nodes(args: argparse.Namespace) -> int:
    from hpcdist.config import load_site
    from hpcdist.store.records import health

    site = load_site(args.site, [s.removeprefix("site.") for s in args.sets])
    if args.clear is not None:
        node = None if args.clear == "all" else args.clear
        done = health.clear(site, node)
        total = done.removed + done.overridden
        said = (f" ({', '.join(done.authors)}'s: a clear mark of yours, newer, makes every reader ignore "
                f"{'them' if done.overridden > 1 else 'it'}; the files stay until they expire or root removes them)"
                if done.overridden else "")
        print(f"forgot {total} mark{'s' if total != 1 else ''} of {args.clear if node else 'every node'} "
              f"in {health.folder(site)}{said}")
        return 0
    if args.mark is not None:
        if not args.reason.strip():
            raise ConfigError(f"--mark {args.mark}: say why with --reason TEXT (it is shown to every user of the site)")
        m = health.mark(site, args.mark, args.reason, source="user")
        print(f"marked {m.describe()}")
        return 0
    return _show(site, args.json)


def _show(site: Any, as_json: bool) -> int:
    from hpcdist.store.records import health

    window_s = site.health.exclude_for_h * 3600.0
    marks = health.marks(site)
    by_node: dict[str, list[health.Mark]] = {}
    for m in marks:
        by_node.setdefault(m.node, []).append(m)
    states: dict[str, Any] | None = {}
    slurm_error = ""
    if site.scheduler == "slurm":
        from hpcdist.scheduler.slurm_cluster import node_states

        states = node_states()
        if states is None:
            slurm_error = "sinfo could not be asked: Slurm's node states are unknown"
    states = states or {}
    names = sorted(set(by_node) | {n for n, s in states.items() if s.reason}, key=_natural)
    now = time.time()
    rows: list[dict[str, Any]] = []
    for name in names:
        own = by_node.get(name, [])
        newest = own[-1] if own else None
        until = newest.when + window_s if newest is not None and window_s > 0 else None
        slurm = states.get(name)
        rows.append({
            "node": name,
            "excluded": until is not None and until > now,
            "excluded_until": _iso(until) if until is not None and until > now else None,
            "marks": [vars(m) for m in own],
            "slurm": None if slurm is None else {"state": slurm.state, "reason": slurm.reason,
                                                 "partitions": list(slurm.partitions)},
        })
    if as_json:
        print(json.dumps({"site": site.name, "record": str(health.folder(site)),
                          "exclude_for_h": site.health.exclude_for_h, "nodes": rows,
                          "slurm_error": slurm_error}, indent=1))
        return 0
    from hpcdist.console import table, text

    if not rows:
        print(f"no node is marked bad in {health.folder(site)}"
              + (", and Slurm gives no node a reason" if site.scheduler == "slurm" else ""))
    else:
        grid = table("node", "excluded until", "marks", "newest mark", "slurm state", "slurm reason", left=6)
        for row in rows:
            newest = row["marks"][-1] if row["marks"] else None
            said = (f"{newest['source']}, job {newest['job_id'] or '-'}, {_iso(newest['when'])}: {newest['reason']}"
                    if newest else "-")
            slurm = row["slurm"] or {"state": "?", "reason": ""}
            grid.add_row(row["node"], row["excluded_until"] or "-", str(len(row["marks"])), said,
                         slurm["state"], slurm["reason"] or "-")
        print(text(grid), end="")
        hours = site.health.exclude_for_h
        print(f"(submissions exclude a node for {hours:g} h after its newest mark (site health.exclude_for_h); "
              f"`hpcdist nodes --clear NODE` forgets one)" if hours else
              "(site health.exclude_for_h is 0: submissions exclude no marked node)")
    if slurm_error:
        print(slurm_error)
    return 0


def _natural(name: str) -> tuple[Any, ...]:
    """n2 before n10."""
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))

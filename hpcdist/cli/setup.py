"""``hpcdist sites`` and ``hpcdist env``: which site configs there are, and what a node's
bootstrap would see here (``hpcdist.config``, ``hpcdist.runtime.doctor``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def cmd_env(args: argparse.Namespace) -> int:
    from hpcdist.runtime.doctor import describe

    print(describe(dict(os.environ)))
    return 0


def cmd_sites(args: argparse.Namespace) -> int:
    from hpcdist.config import find_site, load_site, site_names
    from hpcdist.console import table, text

    if args.show:
        path = find_site(args.show)
        load_site(args.show)  # one ConfigError for a file that does not load
        sys.stdout.write(f"# {path}\n{path.read_text()}")
        return 0
    grid = table("site", "scheduler", "partitions", "file", left=4)
    from hpcdist.errors import HpcdistError

    for name in site_names():
        try:
            site = load_site(name)
        except HpcdistError as exc:  # one site that does not load (a cluster not answering) is its row
            grid.add_row(name, "?", str(exc), "")
            continue
        parts = ", ".join(
            f"{p}: {v.nodes}x{v.gpus_per_node} GPU" if v.gpus_per_node else f"{p}: {v.nodes} nodes"
            for p, v in site.partitions.items()
        )
        grid.add_row(name, site.scheduler, parts, str(find_site(name)))
    sys.stdout.write(text(grid))
    return 0


def add_parser(subs: Any) -> None:
    p = subs.add_parser("sites", help="list known site configs; --show NAME prints one (slurm: the cluster srun "
                                      "talks to, as hpcdist read it)")
    p.add_argument("--show", metavar="SITE", help="print this site's file, comments included")
    subs.add_parser("env", help="what the bootstrap sees on this node")

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

    grid = table("site", "scheduler", "partitions", "file", left=4)
    for name in site_names():
        site = load_site(name)
        parts = ", ".join(
            f"{p}: {v.nodes}x{v.gpus_per_node} GPU" if v.gpus_per_node else f"{p}: {v.nodes} nodes"
            for p, v in site.partitions.items()
        )
        grid.add_row(name, site.scheduler, parts, str(find_site(name)))
    sys.stdout.write(text(grid))
    return 0


def add_parser(subs: Any) -> None:
    subs.add_parser("sites", help="list known site configs")
    subs.add_parser("env", help="what the bootstrap sees on this node")

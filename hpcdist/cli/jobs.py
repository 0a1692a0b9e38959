"""``hpcdist jobs``, ``status``, ``logs``, ``wait``, ``cancel``: a job's life after submit, found
from its id (``hpcdist.login.lifecycle``, ``hpcdist.login.joblogs``; Slurm's own word through
``hpcdist.scheduler.slurm``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_jobs(args: argparse.Namespace) -> int:
    from hpcdist.login import lifecycle

    return int(lifecycle.cmd_jobs(args))


def cmd_wait(args: argparse.Namespace) -> int:
    from hpcdist.login import lifecycle

    return int(lifecycle.cmd_wait(args))


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpcdist.login import lifecycle

    return int(lifecycle.cmd_cancel(args))


def cmd_logs(args: argparse.Namespace) -> int:
    from hpcdist.login import joblogs

    return int(joblogs.cmd_logs(args))


def cmd_status(args: argparse.Namespace) -> int:
    from hpcdist.console import table, text
    from hpcdist.errors import SubmitError
    from hpcdist.scheduler.slurm import sacct_rows, squeue_rows

    # The controller's own word while it holds the job (queued, running, or ended within MinJobAge):
    # accounting may not have the job's record yet, and then `sacct -j` returns an older job that had
    # the same id before Slurm's job ids were reset.
    held = squeue_rows([args.job_id]) or {}
    rows = [held[args.job_id]] if args.job_id in held else sacct_rows([args.job_id])
    if not rows:
        raise SubmitError(f"Slurm knows no job {args.job_id}; check the id with `sacct` or `squeue`")
    grid = table("job", "name", "state", "exit", "elapsed", "nodes", left=("job", "name", "state", "nodes"))
    for row in rows:
        grid.add_row(row.job_id, row.name, row.state, row.exit_code, row.elapsed, row.nodes)
    sys.stdout.write(text(grid))
    return 0


def job_site_arg(p: argparse.ArgumentParser) -> None:
    """`--site` of a command that finds a submitted job: a name or a YAML path, as submit takes
    it (``hpcdist.login.jobindex.lookup``)."""
    p.add_argument("--site", default=None, metavar="SITE",
                   help="the job's site as given to submit, a name or a YAML path (needed when two sites "
                        "have a job of that id)")


def add_parser(subs: Any) -> None:
    """argparse only: building the parser imports neither side of the flow."""
    p = subs.add_parser("jobs", help="the jobs submitted from here: state, elapsed time, nodes, result")
    p.add_argument("--last", type=int, default=20, metavar="N", help="the newest N jobs (default 20; 0: all)")
    p.add_argument("--json", action="store_true", help="the rows as JSON (state, paths), for scripts")
    p = subs.add_parser("status", help="a job's state from Slurm (the controller while it holds the job, else sacct)")
    p.add_argument("job_id")
    p = subs.add_parser("logs", help="a job's per-rank logs, found from its id; -f follows them while it runs")
    p.add_argument("job_id", help="the id `hpcdist submit` printed")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=None, help="this rank's logs (default: rank 0)")
    which.add_argument("--all", action="store_true", help="every rank's logs, rank by rank")
    p.add_argument("-f", "--follow", action="store_true", help="follow the logs until the job ends")
    p.add_argument("--tail", type=int, default=None, metavar="K", help="only the last K lines of each file")
    job_site_arg(p)
    for name, what in (("wait", "wait for a job and print its per-rank summary (as submit --wait)"),
                       ("cancel", "cancel a job (scancel; on the local site, its ranks' processes)")):
        p = subs.add_parser(name, help=what)
        p.add_argument("job_id", help="the id `hpcdist submit` printed")
        job_site_arg(p)
        if name == "cancel":
            p.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                           help="local site: kill (SIGKILL) what of the job still runs this long after the cancel "
                                "(default 10)")
        if name == "wait":
            p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")

"""``hpcdist render`` and ``hpcdist submit``: a job spec (or ``-- SCRIPT ARG...``) and a site made
into the script, shown or submitted (``hpcdist.login.load``, ``plan``, ``render``, ``lifecycle``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

PYDANTIC_PLUGINS_VAR = "PYDANTIC_DISABLE_PLUGINS"  # pydantic's documented switch; "__all__": none


def _warn(message: str) -> None:
    print(f"hpcdist: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def no_pydantic_plugins() -> Iterator[None]:
    """hpcdist's own models (site, job spec, params) validated without pydantic's plugins: the
    search for them reads every installed package's entry points, a few ms of each start, and a
    plugin is for the user's models. Set only while the config loads (unless the user set it),
    so no job, sbatch or local controller inherits it."""
    if PYDANTIC_PLUGINS_VAR in os.environ:
        yield
        return
    os.environ[PYDANTIC_PLUGINS_VAR] = "__all__"
    try:
        yield
    finally:
        os.environ.pop(PYDANTIC_PLUGINS_VAR, None)


def request(args: argparse.Namespace) -> Any:
    """What the user asked `render` or `submit` for, as plain values (``hpcdist.login.load.Request``)."""
    from hpcdist.login.load import Request

    return Request(args.site, tuple(args.sets), args.job, tuple(args.argv or ()), tuple(getattr(args, "after", ())),
                   tuple(getattr(args, "sweeps", ())), getattr(args, "max_parallel", None))


def cmd_render(args: argparse.Namespace) -> int:
    from hpcdist.login import load, plan, render

    req = request(args)
    with no_pydantic_plugins():
        job, site, origin = load.load(req, on_missing=_warn)  # a missing input is a warning here
        tasks = [j.spec for j in load.sweep_jobs(req, site, on_missing=_warn)] if req.sweeps else []
    if tasks and site.scheduler != "slurm":  # a local site runs a sweep's tasks one at a time: the first
        tasks, origin = [], dataclasses.replace(origin, sweeps=())
    made = plan.make(job.spec, site, origin, tasks)
    if made.gpu_note:
        print(f"hpcdist: note: {made.gpu_note}", file=sys.stderr)
    sys.stdout.write(render.script(made))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcdist.login import lifecycle

    with no_pydantic_plugins():
        return lifecycle.submit(request(args), [p for p in (args.job, *args.more) if p], args.chain,
                                args.wait, args.wait_timeout)


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="?", default=None,
                   help="job spec YAML, e.g. jobs/smoke.yaml; or none and `-- SCRIPT ARG...` after the options")
    p.add_argument("--site", default=None, help="site name or YAML (default: $HPCDIST_SITE or local)")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="override a job key (resources.nodes=2) or a site key (site.launcher.kind=mpirun)",
    )


def _placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--after", action="append", default=[], metavar="JOBID",
                   help="start only after job JOBID completed successfully (Slurm's afterok)")
    p.add_argument("--sweep", dest="sweeps", action="append", default=[], metavar="KEY=V1,V2",
                   help="one task per combination of the values, as one job array (params.* keys)")
    p.add_argument("--max-parallel", type=int, default=None, metavar="N",
                   help="run at most N tasks of a sweep at a time (the array's %%N)")


def add_parser(subs: Any) -> None:
    p = subs.add_parser("render", help="print the job script that submit would submit")
    _job_args(p)
    _placement_args(p)
    p = subs.add_parser("submit", help="submit a job through submitit")
    _job_args(p)
    p.add_argument("more", nargs="*", default=[], metavar="MORE.yaml", help="further job specs, with --chain")
    p.add_argument("--chain", action="store_true", help="submit the specs in order, each after the one before")
    _placement_args(p)
    p.add_argument("--wait", action="store_true", help="wait for the job and print its summary")
    p.add_argument("--wait-timeout", type=float, default=None, help="give up waiting after this many seconds")

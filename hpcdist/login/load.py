"""A job loaded in one pass, as the user asked for it: the site (with its ``--set site.…``
overrides), then the spec (read once, overrides applied, its kind resolved, checked against the
site), and how it was asked for (``Origin``); a ``-- SCRIPT`` command as a ``python`` job, a
sweep's jobs, a chain's links. What comes out is what ``hpcdist.login.plan.make`` resolves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import ConfigError
from hpcdist.login.plan import Origin

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.kinds.registry import Job


@dataclass(frozen=True)
class Request:
    """What the user asked for on the command line (or through the Python API)."""

    site: str | None
    sets: tuple[str, ...] = ()
    job: str | None = None  # a spec file, or None with `argv`
    argv: tuple[str, ...] = ()  # `-- SCRIPT ARG...`
    after: tuple[str, ...] = ()
    sweeps: tuple[str, ...] = ()
    max_parallel: int | None = None

    @property
    def site_sets(self) -> list[str]:
        """`--set site.KEY=V` goes to the site config, any other `--set KEY=V` to the job spec."""
        return [s.removeprefix("site.") for s in self.sets if s.startswith("site.")]

    @property
    def job_sets(self) -> list[str]:
        return [s for s in self.sets if not s.startswith("site.")]


Warn = Callable[[str], None]


def load(request: Request, path: str | None = None, after: Sequence[str] | None = None,
         made_earlier: Sequence[Path] = (), on_missing: Warn | None = None) -> tuple[Job[Any], Site, Origin]:
    """The site, then the job (its params parsed and checked against the site), and the origin.
    `path`: another spec than ``request.job`` (a chain's link); `after`: the job ids it waits
    for; `made_earlier`: inputs an earlier link writes; `on_missing`: warn of a missing input
    instead of refusing it (``render``)."""
    from hpcdist.config import load_site
    from hpcdist.kinds.registry import load_job

    path = path or request.job
    site = load_site(request.site, request.site_sets)
    if request.argv:
        job = command_job(request.argv, site, request.job_sets)
    else:
        job = load_job(str(path), site, request.job_sets, on_missing=on_missing, made_earlier=made_earlier)
    limit = request.max_parallel
    if limit is not None and (limit < 1 or not request.sweeps):
        raise ConfigError(f"--max-parallel {limit}: give a number of at least 1, with --sweep (it limits an array)")
    origin = Origin(path or "", request.site or site.name, request.sets, request.argv,
                    after=tuple(request.after if after is None else after), sweeps=request.sweeps,
                    max_parallel=limit)
    return job, site, origin


def command_job(argv: Sequence[str], site: Site, job_sets: list[str]) -> Job[Any]:
    """`-- train.py ARG...` (or `-- -m pkg.mod ARG...`) as a ``python`` job spec, no YAML."""
    from hpcdist.config import apply_overrides, validate
    from hpcdist.config.spec import JobSpec
    from hpcdist.kinds.registry import resolve

    if argv[0] == "-m":
        if len(argv) < 2:
            raise ConfigError("-- -m: a module name must follow -m, e.g. -- -m mypkg.train")
        target, args, name = {"module": argv[1]}, list(argv[2:]), argv[1].rsplit(".", 1)[-1]
    else:
        target, args, name = {"script": argv[0]}, list(argv[1:]), Path(argv[0]).stem
    data = apply_overrides({"name": name or "python", "kind": "python", "params": {**target, "args": args}},
                           job_sets, "job")
    return resolve(validate(JobSpec, data, "command line"), site, origin="command line")


def sweep_jobs(request: Request, site: Site, on_missing: Warn | None = None) -> list[Job[Any]]:
    """One job per combination of the --sweep values, each checked and named with its suffix;
    the spec file is read once."""
    from hpcdist.config.sweep import task_name, tasks
    from hpcdist.kinds.registry import load_jobs

    if request.argv or not request.job:
        raise ConfigError("--sweep needs a job spec YAML; sweep a `-- SCRIPT` job by writing its spec")
    combos = tasks(request.sweeps)
    jobs = load_jobs(request.job, site, request.job_sets, [t.overrides for t in combos], on_missing=on_missing)
    return [dataclasses.replace(job, spec=job.spec.model_copy(update={"name": task_name(job.spec.name, task)}))
            for job, task in zip(jobs, combos, strict=True)]


def chain_links(request: Request, paths: Sequence[str]) -> list[tuple[Job[Any], Site, Origin]]:
    """Every link of a chain loaded and checked before the first is submitted; a link may read
    the checkpoints an earlier link writes."""
    links: list[tuple[Job[Any], Site, Origin]] = []
    for path in paths:
        made = [link[0].spec.paths(link[1]).checkpoints for link in links]
        links.append(load(request, path, after=(), made_earlier=made))
    return links

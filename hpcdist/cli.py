"""The ``hpcdist`` command: render, submit, status, env, sites.

The only module that imports both sides of the flow. Every ``HpcdistError`` is printed as one
line and the exit code is non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcdist import __version__
from hpcdist.errors import HpcdistError

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, Command] = {}


def command(name: str) -> Callable[[Command], Command]:
    def deco(fn: Command) -> Command:
        if name in _COMMANDS:
            raise ValueError(f"command {name!r} registered twice")
        _COMMANDS[name] = fn
        return fn

    return deco


def _split_sets(sets: Sequence[str]) -> tuple[list[str], list[str]]:
    """`--set site.KEY=V` goes to the site config, any other `--set KEY=V` to the job spec."""
    site = [s.removeprefix("site.") for s in sets if s.startswith("site.")]
    job = [s for s in sets if not s.startswith("site.")]
    return site, job


def _load_job(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The site, then the job (its params parsed and checked against the site), and the origin."""
    from hpcdist.config import load_site
    from hpcdist.jobs.registry import load_job
    from hpcdist.render import Origin

    site_sets, job_sets = _split_sets(args.sets)
    site = load_site(args.site, site_sets)
    argv = tuple(args.argv or ())
    if argv:
        job = _command_job(argv, site, job_sets)
    else:
        job = load_job(args.job, site, job_sets)
    origin = Origin(args.job or "", args.site or site.name, tuple(args.sets), argv)
    return job, site, origin


def _command_job(argv: tuple[str, ...], site: Any, job_sets: list[str]) -> Any:
    """`-- train.py ARG...` (or `-- -m pkg.mod ARG...`) as a ``python`` job spec, no YAML."""
    from hpcdist.config import apply_overrides, validate
    from hpcdist.config.spec import JobSpec
    from hpcdist.jobs.registry import resolve

    if argv[0] == "-m":
        if len(argv) < 2:
            from hpcdist.errors import ConfigError

            raise ConfigError("-- -m: a module name must follow -m, e.g. -- -m mypkg.train")
        target, args, name = {"module": argv[1]}, list(argv[2:]), argv[1].rsplit(".", 1)[-1]
    else:
        target, args, name = {"script": argv[0]}, list(argv[1:]), Path(argv[0]).stem
    data = apply_overrides({"name": name or "python", "kind": "python", "params": {**target, "args": args}},
                           job_sets, "job")
    return resolve(validate(JobSpec, data, "command line"), site, origin="command line")


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The site, then the job spec with its params parsed and checked against the site."""
    job, site, origin = _load_job(args)
    return job.spec, site, origin


@command("render")
def cmd_render(args: argparse.Namespace) -> int:
    from hpcdist.render import render

    spec, site, origin = _load(args)
    sys.stdout.write(render(spec, site, origin))
    return 0


@command("submit")
def cmd_submit(args: argparse.Namespace) -> int:
    from hpcdist import submit as sub
    from hpcdist.jobs.registry import prepare

    job, site, origin = _load_job(args)
    spec = prepare(job, site).spec
    t0 = time.perf_counter()
    submission = sub.submit(spec, site, origin)
    took = time.perf_counter() - t0
    out, err = submission.log_paths
    print(f"submitted job {submission.job_id} ({spec.name}, kind {spec.kind}) to site {site.name} in {took:.2f} s")
    print(f"  logs:   {out}")
    print(f"          {err}")
    print(f"  result: {submission.result_path}")
    if not args.wait:
        return 0
    finished = sub.wait(submission, timeout_s=args.wait_timeout)
    outcomes = finished.outcomes
    failed = [o for o in outcomes if not o.ok]
    print(f"job {submission.job_id} finished: {finished.state.value}; "
          f"{len(outcomes) - len(failed)}/{len(outcomes)} ranks succeeded")
    if finished.cause:
        print(f"  cause: {finished.cause}")
    for o in outcomes:
        if o.ok:
            shown = {k: v for k, v in o.summary.items() if k not in ("rank", "timings")}
            print(f"  rank {o.rank}: ok {json.dumps(shown, default=str)}")
        else:
            print(f"  rank {o.rank}: FAILED {o.error}")
    return 0 if finished.ok else 1


@command("status")
def cmd_status(args: argparse.Namespace) -> int:
    from hpcdist.console import table, text
    from hpcdist.submit import status

    grid = table("job", "name", "state", "exit", "elapsed", "nodes", left=("job", "name", "state", "nodes"))
    for row in status(args.job_id):
        grid.add_row(row.job_id, row.name, row.state, row.exit_code, row.elapsed, row.nodes)
    sys.stdout.write(text(grid))
    return 0


@command("env")
def cmd_env(args: argparse.Namespace) -> int:
    from hpcdist.runtime.doctor import describe

    print(describe(dict(os.environ)))
    return 0


@command("sites")
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


def _result_kind(path: str) -> str:
    """The job kind recorded in a result file, or one clear error for anything else."""
    from hpcdist.errors import JobError
    from hpcdist.store.results import read_attrs

    if not os.path.isfile(path):
        raise JobError(f"result file {path!r} does not exist; `hpcdist submit` prints where a result lands")
    try:
        return str(read_attrs(Path(path)).get("kind", ""))
    except OSError as exc:
        raise JobError(f"{path} is not an HDF5 file ({exc})") from None
    except ValueError as exc:  # read_attrs names the file and the format it found
        raise JobError(str(exc)) from None


@command("report")
def cmd_report(args: argparse.Namespace) -> int:
    from hpcdist.errors import JobError

    kind = _result_kind(args.result)
    if not kind.startswith("bench_"):
        if args.plot or args.compare:
            raise JobError(f"--plot and --compare are for benchmark results; {args.result} is a {kind} result")
        if kind in ("infer_gpt", "broadcast"):
            from hpcdist.infer.report import render_infer_report

            sys.stdout.write(render_infer_report(args.result) + "\n")
            return 0
        from hpcdist.store.results import summarize

        sys.stdout.write(summarize(Path(args.result)))
        return 0
    from hpcdist.bench import report

    result = report.load(args.result)
    other = report.load(args.compare) if args.compare else None
    sys.stdout.write(report.format_report(result))
    if other is not None:
        sys.stdout.write("\n" + report.format_comparison(result, other))
    if args.plot:
        for path in report.plot(result, args.plot, other):
            print(f"wrote {path}")
    return 0


def _report_parser(subs: Any) -> None:
    p = subs.add_parser("report", help="print a result (benchmark, inference); plot or compare benchmarks")
    p.add_argument("result", help="a result file written by a bench_*, infer_gpt or broadcast job")
    p.add_argument("--plot", metavar="DIR", default=None, help="also write PNG plots into DIR")
    p.add_argument("--compare", metavar="OTHER.h5", default=None, help="a second result to compare side by side")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcdist", description="Distributed PyTorch jobs on Slurm clusters.")
    parser.add_argument("--version", action="version", version=f"hpcdist {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    subs = parser.add_subparsers(dest="command", required=True)

    def job_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", nargs="?", default=None,
                       help="job spec YAML, e.g. jobs/smoke.yaml; or none and `-- SCRIPT ARG...` after the options")
        p.add_argument("--site", default=None, help="site name or YAML (default: $HPCDIST_SITE or local)")
        p.add_argument(
            "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
            help="override a job key (resources.nodes=2) or a site key (site.launcher.kind=mpirun)",
        )

    job_args(subs.add_parser("render", help="print the job script that submit would submit"))
    p = subs.add_parser("submit", help="submit a job through submitit")
    job_args(p)
    p.add_argument("--wait", action="store_true", help="wait for the job and print its summary")
    p.add_argument("--wait-timeout", type=float, default=None, help="give up waiting after this many seconds")
    p = subs.add_parser("status", help="a job's state from Slurm")
    p.add_argument("job_id")
    subs.add_parser("env", help="what the bootstrap sees on this node")
    subs.add_parser("sites", help="list known site configs")
    for extra in _EXTRA_PARSERS:
        extra(subs)
    return parser


# Later stages (report, data) add their subcommands here.
_EXTRA_PARSERS: list[Callable[[Any], None]] = [_report_parser]


@command("data")
def cmd_data(args: argparse.Namespace) -> int:
    from hpcdist.data.cli import cmd_data as run

    return run(args)


def _data_parser(subs: Any) -> None:
    from hpcdist.data.cli import add_parser

    add_parser(subs)


_EXTRA_PARSERS.append(_data_parser)


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """hpcdist's own arguments, and the user's command after the first `--` (render, submit)."""
    if "--" in argv:
        i = argv.index("--")
        if any(a in ("render", "submit") for a in argv[:i]):
            return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    own, command_argv = _split_command(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(own)
    if args.command in ("render", "submit"):
        args.argv = command_argv
        if bool(args.job) == bool(command_argv):
            parser.error(f"{args.command}: give a job spec YAML or `-- SCRIPT ARG...`, not both or neither")
    try:
        return _COMMANDS[args.command](args)
    except HpcdistError as exc:
        if args.debug:
            raise
        print(f"hpcdist: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

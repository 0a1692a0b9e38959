"""The ``hpcdist`` command: render, submit, status, env, sites.

The only module that imports both sides of the flow. Every ``HpcdistError`` is printed as one
line and the exit code is non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence
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


def _warn(message: str) -> None:
    print(f"hpcdist: warning: {message}", file=sys.stderr)


PYDANTIC_PLUGINS_VAR = "PYDANTIC_DISABLE_PLUGINS"  # pydantic's documented switch; "__all__": none


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
    """What the user asked `render` or `submit` for, as plain values (``hpcdist.login.plan.Request``)."""
    from hpcdist.login.plan import Request

    return Request(args.site, tuple(args.sets), args.job, tuple(args.argv or ()), tuple(getattr(args, "after", ())),
                   tuple(getattr(args, "sweeps", ())), getattr(args, "max_parallel", None))


@command("render")
def cmd_render(args: argparse.Namespace) -> int:
    from hpcdist.login import plan

    req = request(args)
    with no_pydantic_plugins():
        job, site, origin = plan.load(req, on_missing=_warn)  # a missing input is a warning here
        tasks = [j.spec for j in plan.sweep_jobs(req, site, on_missing=_warn)] if req.sweeps else []
    if tasks and site.scheduler != "slurm":  # a local site runs a sweep's tasks one at a time: the first
        tasks, origin = [], dataclasses.replace(origin, sweeps=())
    sys.stdout.write(plan.make(job.spec, site, origin, tasks).script)
    return 0


@command("submit")
def cmd_submit(args: argparse.Namespace) -> int:
    from hpcdist.login import lifecycle

    with no_pydantic_plugins():
        return lifecycle.submit(request(args), [p for p in (args.job, *args.more) if p], args.chain,
                                args.wait, args.wait_timeout)


@command("status")
def cmd_status(args: argparse.Namespace) -> int:
    from hpcdist.console import table, text
    from hpcdist.errors import SubmitError
    from hpcdist.scheduler.slurm import sacct_rows

    rows = sacct_rows([args.job_id])
    if not rows:
        raise SubmitError(f"Slurm knows no job {args.job_id}; check the id with `sacct` or `squeue`")
    grid = table("job", "name", "state", "exit", "elapsed", "nodes", left=("job", "name", "state", "nodes"))
    for row in rows:
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
    if args.compare and not kind.startswith("bench_"):
        from hpcdist.store.compare import format_results

        for other in args.compare:
            _result_kind(other)
        try:
            sys.stdout.write(format_results([args.result, *args.compare]))
        except ValueError as exc:
            raise JobError(str(exc)) from None
        return 0
    if len(args.compare or ()) > 1:
        raise JobError(f"a benchmark result compares with one other; got {len(args.compare)}")
    if kind == "train_gpt":
        from hpcdist.train.report import plot_train, render_train_report

        try:
            sys.stdout.write(render_train_report(args.result))
            for path in plot_train(args.result, args.plot) if args.plot else ():
                print(f"wrote {path}")
        except ValueError as exc:
            raise JobError(str(exc)) from None
        return 0
    if not kind.startswith("bench_"):
        if args.plot:
            raise JobError(f"--plot is for benchmark and training results; {args.result} is a {kind} result")
        if kind in ("infer_gpt", "broadcast"):
            from hpcdist.infer.report import render_infer_report

            sys.stdout.write(render_infer_report(args.result) + "\n")
            return 0
        from hpcdist.store.results import summarize

        sys.stdout.write(summarize(Path(args.result)))
        return 0
    from hpcdist.bench import report

    result = report.load(args.result)
    other = report.load(args.compare[0]) if args.compare else None
    sys.stdout.write(report.format_report(result))
    if other is not None:
        sys.stdout.write("\n" + report.format_comparison(result, other))
    if args.plot:
        for path in report.plot(result, args.plot, other):
            print(f"wrote {path}")
    return 0


def _report_parser(subs: Any) -> None:
    p = subs.add_parser("report", help="print a result (benchmark, training, inference); plot benchmarks and losses")
    p.add_argument("result", help="a result file written by a bench_*, train_gpt, infer_gpt or broadcast job")
    p.add_argument("--plot", metavar="DIR", default=None, help="also write PNG plots into DIR")
    p.add_argument("--compare", metavar="OTHER.h5", nargs="+", default=None,
                   help="results to show side by side with the first (benchmarks: one; training, inference: any)")


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


def _render_parser(subs: Any) -> None:
    p = subs.add_parser("render", help="print the job script that submit would submit")
    _job_args(p)
    _placement_args(p)


def _submit_parser(subs: Any) -> None:
    p = subs.add_parser("submit", help="submit a job through submitit")
    _job_args(p)
    p.add_argument("more", nargs="*", default=[], metavar="MORE.yaml", help="further job specs, with --chain")
    p.add_argument("--chain", action="store_true", help="submit the specs in order, each after the one before")
    _placement_args(p)
    p.add_argument("--wait", action="store_true", help="wait for the job and print its summary")
    p.add_argument("--wait-timeout", type=float, default=None, help="give up waiting after this many seconds")


def _small_parsers(subs: Any) -> None:
    p = subs.add_parser("status", help="a job's state from Slurm")
    p.add_argument("job_id")
    subs.add_parser("env", help="what the bootstrap sees on this node")
    subs.add_parser("sites", help="list known site configs")


# Each command's subparser, in the order `hpcdist --help` lists them: (the commands a function
# adds, the function). Later stages (report, data, model, the lifecycle) add theirs below.
_PARSERS: list[tuple[tuple[str, ...], Callable[[Any], None]]] = [
    (("render",), _render_parser),
    (("submit",), _submit_parser),
    (("status", "env", "sites"), _small_parsers),
    (("report",), _report_parser),
]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, only that command's subparser (what `main` parses a
    command line with: building every subparser costs more than parsing one)."""
    parser = argparse.ArgumentParser(prog="hpcdist", description="Distributed PyTorch jobs on Slurm clusters.")
    parser.add_argument("--version", action="version", version=f"hpcdist {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    subs = parser.add_subparsers(dest="command", required=True)
    for names, add in _PARSERS:
        if command is None or command in names:
            add(subs)
    return parser


def _module_subcommand(name: str, module: str) -> None:
    """`hpcdist NAME ...` owned by `module` (its ``add_parser(subs)`` and ``cmd_NAME(args)``),
    imported only when the parser is built or the command runs: ``data``, ``model``, ``ckpt``."""
    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), f"cmd_{name}")(args))

    def parser(subs: Any) -> None:
        importlib.import_module(module).add_parser(subs)

    command(name)(run)
    _PARSERS.append(((name,), parser))


_module_subcommand("data", "hpcdist.data.cli")
_module_subcommand("model", "hpcdist.model.cli")
_module_subcommand("nodes", "hpcdist.login.nodes")
_module_subcommand("stacks", "hpcdist.login.stacks")
_module_subcommand("ckpt", "hpcdist.store.cli")


def _lifecycle(name: str) -> Command:
    """`jobs`, `logs`, `wait`, `cancel`: a job's life after submit (hpcdist.login.lifecycle, hpcdist.login.joblogs)."""
    def run(args: argparse.Namespace) -> int:
        from hpcdist.login import joblogs, lifecycle

        return int(getattr(lifecycle if name != "logs" else joblogs, f"cmd_{name}")(args))

    return command(name)(run)


for _name in ("jobs", "logs", "wait", "cancel"):
    _lifecycle(_name)


def _lifecycle_parsers(subs: Any) -> None:
    """argparse only: building the parser imports neither side of the flow."""
    p = subs.add_parser("logs", help="a job's per-rank logs, found from its id; -f follows them while it runs")
    p.add_argument("job_id", help="the id `hpcdist submit` printed")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=None, help="this rank's logs (default: rank 0)")
    which.add_argument("--all", action="store_true", help="every rank's logs, rank by rank")
    p.add_argument("-f", "--follow", action="store_true", help="follow the logs until the job ends")
    p.add_argument("--tail", type=int, default=None, metavar="K", help="only the last K lines of each file")
    p.add_argument("--site", default=None, help="the job's site, when two sites have a job of that id")
    p = subs.add_parser("jobs", help="the jobs submitted from here: state, elapsed time, nodes, result")
    p.add_argument("--last", type=int, default=20, metavar="N", help="the newest N jobs (default 20; 0: all)")
    p.add_argument("--json", action="store_true", help="the rows as JSON (state, paths), for scripts")
    for name, what in (("wait", "wait for a job and print its per-rank summary (as submit --wait)"),
                       ("cancel", "cancel a job (scancel; on the local site, its ranks' processes)")):
        p = subs.add_parser(name, help=what)
        p.add_argument("job_id", help="the id `hpcdist submit` printed")
        p.add_argument("--site", default=None, help="the job's site, when two sites have a job of that id")
        if name == "wait":
            p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")


_PARSERS.append((("logs", "jobs", "wait", "cancel"), _lifecycle_parsers))


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """hpcdist's own arguments, and the user's command after the first `--` (render, submit)."""
    if "--" in argv:
        i = argv.index("--")
        if any(a in ("render", "submit") for a in argv[:i]):
            return argv[:i], argv[i + 1:]
    return argv, []


def _parse(own: list[str]) -> argparse.Namespace:
    """`own` parsed by a parser holding only its command's subparser; a command line that
    fails there is parsed again by the whole parser, whose message and usage it then prints."""
    name = next((a for a in own if not a.startswith("-")), None)
    if name is not None and any(name in names for names, _ in _PARSERS):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                return build_parser(name).parse_args(own)
        except SystemExit as exc:
            if exc.code == 0:  # --help, --version: printed to stdout already
                raise
    return build_parser().parse_args(own)


def main(argv: Sequence[str] | None = None) -> int:
    own, command_argv = _split_command(list(sys.argv[1:] if argv is None else argv))
    args = _parse(own)
    if args.command in ("render", "submit"):
        args.argv = command_argv
        if bool(args.job) == bool(command_argv):
            build_parser().error(f"{args.command}: give a job spec YAML or `-- SCRIPT ARG...`, not both or neither")
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

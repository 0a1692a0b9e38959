"""``hpcdist report RESULT``: a result file printed by its kind (benchmark, training, inference,
any other), plotted (``--plot``) or set beside others (``--compare``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def _result_kind(path: str) -> str:
    """The job kind recorded in a result file, or one clear error for anything else."""
    from hpcdist.errors import JobError
    from hpcdist.files.roots import refusal
    from hpcdist.store.results import read_attrs

    why = refusal(path)
    if why is not None:
        raise JobError(f"result file {path!r} cannot be read: {why}")
    if not os.path.isfile(path):
        raise JobError(f"result file {path!r} does not exist; `hpcdist submit` prints where a result lands")
    try:
        return str(read_attrs(Path(path)).get("kind", ""))
    except OSError as exc:
        raise JobError(f"{path} is not an HDF5 file ({exc})") from None
    except ValueError as exc:  # read_attrs names the file and the format it found
        raise JobError(str(exc)) from None


def cmd_report(args: argparse.Namespace) -> int:
    from hpcdist.errors import JobError

    kind = _result_kind(args.result)
    if args.compare and not kind.startswith("bench_"):
        from hpcdist.store.results.compare import format_results

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


def add_parser(subs: Any) -> None:
    p = subs.add_parser("report", help="print a result (benchmark, training, inference); plot benchmarks and losses")
    p.add_argument("result", help="a result file written by a bench_*, train_gpt, infer_gpt or broadcast job")
    p.add_argument("--plot", metavar="DIR", default=None, help="also write PNG plots into DIR")
    p.add_argument("--compare", metavar="OTHER.h5", nargs="+", default=None,
                   help="results to show side by side with the first (benchmarks: one; training, inference: any)")

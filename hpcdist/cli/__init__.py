"""The ``hpcdist`` command (login side): one module per command or family, registered by name.

The package is the only place that imports both sides of the flow: the login side
(``hpcdist.login``) for what is planned, submitted and followed, and the node side's readers for
what is inspected (results, checkpoints, models). Each command module has ``add_parser(subs)``,
which adds the parsers of the commands it owns (argparse only: building a parser imports no
workload), and one ``cmd_NAME(args)`` per command. Every ``HpcdistError`` is printed as one line
and the exit code is non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpcdist._version import __version__
from hpcdist.errors import HpcdistError


@dataclass(frozen=True)
class Entry:
    """One command: its name, the group `hpcdist --help` lists it under, and its module."""

    name: str
    group: str
    module: str


# In the order `hpcdist --help` lists them, grouped as a user meets them.
GROUPS = ("set up", "submit", "follow", "inspect", "data and models")
COMMANDS: tuple[Entry, ...] = (
    Entry("sites", "set up", "hpcdist.cli.setup"),
    Entry("site", "set up", "hpcdist.cli.site"),
    Entry("env", "set up", "hpcdist.cli.setup"),
    Entry("render", "submit", "hpcdist.cli.submit"),
    Entry("submit", "submit", "hpcdist.cli.submit"),
    Entry("jobs", "follow", "hpcdist.cli.jobs"),
    Entry("status", "follow", "hpcdist.cli.jobs"),
    Entry("logs", "follow", "hpcdist.cli.jobs"),
    Entry("wait", "follow", "hpcdist.cli.jobs"),
    Entry("cancel", "follow", "hpcdist.cli.jobs"),
    Entry("report", "inspect", "hpcdist.cli.report"),
    Entry("stacks", "inspect", "hpcdist.cli.stacks"),
    Entry("nodes", "inspect", "hpcdist.cli.nodes"),
    Entry("track", "inspect", "hpcdist.cli.track"),
    Entry("data", "data and models", "hpcdist.cli.data"),
    Entry("model", "data and models", "hpcdist.cli.model"),
    Entry("ckpt", "data and models", "hpcdist.cli.ckpt"),
)


def _registry() -> dict[str, Entry]:
    found: dict[str, Entry] = {}
    for entry in COMMANDS:
        if entry.name in found:
            raise ValueError(f"command {entry.name!r} registered twice")
        if entry.group not in GROUPS:
            raise ValueError(f"command {entry.name!r}: unknown group {entry.group!r}; groups are {GROUPS}")
        found[entry.name] = entry
    return found


REGISTRY = _registry()


def _grouped_help(subs: Any) -> str:
    """The commands under their groups, each with its one-line help (argparse's own flat list is
    replaced by this)."""
    helps = {action.dest: action.help or "" for action in subs._choices_actions}
    subs._choices_actions.clear()
    width = max(len(name) for name in helps) + 2
    lines = []
    for group in GROUPS:
        names = [e.name for e in COMMANDS if e.group == group and e.name in helps]
        if names:
            lines.append(f"{group}:")
            lines += [f"  {name:<{width}}{helps[name]}" for name in names]
    return "\n".join(lines) + "\n\n`hpcdist COMMAND --help` for a command's options."


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, only its module's subparsers (what `main` parses a
    command line with: building every subparser costs more than parsing one)."""
    parser = argparse.ArgumentParser(prog="hpcdist", description="Distributed PyTorch jobs on Slurm clusters.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hpcdist {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--on", metavar="HOST", default=None,
                        help="run Slurm's commands on this login node through your ssh (default: $HPCDIST_LOGIN)")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of those below")
    modules = [REGISTRY[command].module] if command in REGISTRY else list(dict.fromkeys(e.module for e in COMMANDS))
    for module in modules:
        importlib.import_module(module).add_parser(subs)
    if command is None:
        parser.epilog = _grouped_help(subs)
    return parser


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """hpcdist's own arguments, and the user's command after the first `--` (render, submit)."""
    if "--" in argv:
        i = argv.index("--")
        if any(a in ("render", "submit") for a in argv[:i]):
            return argv[:i], argv[i + 1:]
    return argv, []


def _parse(own: list[str]) -> argparse.Namespace:
    """`own` parsed by a parser holding only its command's subparsers; a command line that
    fails there is parsed again by the whole parser, whose message and usage it then prints."""
    name = next((a for i, a in enumerate(own) if not a.startswith("-") and (i == 0 or own[i - 1] != "--on")), None)
    if name in REGISTRY:
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
    run = getattr(importlib.import_module(REGISTRY[args.command].module), f"cmd_{args.command}")
    try:
        _login(args)
        code = int(run(args))
        # the interpreter's exit then skips the last collection over everything the command
        # loaded (pydantic's models, the templates): a third of render's time above its libraries
        gc.freeze()
        return code
    except HpcdistError as exc:
        if args.debug:
            raise
        print(f"hpcdist: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # a file no door foresaw, a model's ValidationError: one line
        if args.debug or not (isinstance(exc, OSError) or type(exc).__module__.startswith("pydantic")):
            raise
        print(f"hpcdist: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _login(args: argparse.Namespace) -> None:
    """`--on HOST` (or $HPCDIST_LOGIN): Slurm's commands run there through ssh, whose connection
    opens now, so a refusal is the first and only line (``hpcdist.scheduler.ssh``)."""
    from hpcdist.scheduler import ssh

    if args.on:
        ssh.use(args.on)
    if ssh.login():
        ssh.check()


def _one_line(exc: Exception) -> str:
    """An error no door turned into hpcdist's own, in one line: a PermissionError with whose folder
    refused (``hpcdist.files.roots.denied_hint``), anything else as its type and first line;
    ``--debug`` shows the traceback."""
    from hpcdist.errors import cause_text
    from hpcdist.files.roots import denied_hint

    hint = denied_hint(exc) if isinstance(exc, OSError) else ""
    return f"{cause_text(exc)}{hint} (--debug shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())

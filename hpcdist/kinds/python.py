"""The ``python`` job kind, login side: the user's own script, module or function, and its checks.

    kind: python
    params: {script: train.py, args: ["--lr", "0.1"]}      # or module: pkg.train, or function: pkg.mod:main

Each rank runs the target after hpcdist's rendezvous has set the variables torchrun sets
(``hpcdist.kinds.python_run``), so a script written for torchrun runs unchanged. Everything that
can be wrong with the target is found here, before anything is queued, one ``ConfigError`` each:
a missing script, a module that does not import, a function that is not callable, args that are
not strings, a code snapshot over its size limit. The snapshot itself (``hpcdist.kinds.snapshot``)
is made by ``prepare`` at submit only, never by ``render``.

Light on purpose (pydantic and the standard library): the login node imports it to render.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, StrictStr, model_validator

from hpcdist.config.site import Frozen
from hpcdist.config.spec import SpecPath

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.kinds.registry import Job, Problem


class PythonParams(Frozen):
    """One of ``script``, ``module``, ``function``; its arguments; the code snapshot."""

    script: Annotated[str | None, SpecPath()] = Field(
        default=None, description="a Python file, run as `python FILE ARGS`")
    module: str | None = Field(default=None, description="a module, run as `python -m MODULE ARGS`")
    function: str | None = Field(default=None, description="`package.module:name`, called as name(*args)")
    call: str | None = Field(default=None, description="a pickled call made by hpcdist.Executor: "
                             "(function, args, kwargs), its return value each rank's result")
    call_name: str | None = Field(default=None, description="the called function, `module:qualname`")
    call_module: str | None = Field(default=None, description="the module the nodes import the function "
                                    "from (None: shipped by value, from __main__ or a notebook)")
    direct: bool = Field(default=False, description="an hpcdist.Executor call submitit runs itself (one task, no "
                         "group asked): no bootstrap; each task's result is the function's return value")
    args: list[StrictStr] = Field(default_factory=list, description="sys.argv[1:] (or the function's arguments)")
    snapshot: Annotated[bool | str, SpecPath()] = Field(
        default=True,
        description="copy the code to shared storage at submit: true (the script's directory or the "
        "module's package), a directory, or false (run the code where it is)",
    )
    snapshot_max_mb: float = Field(default=64.0, gt=0, description="refuse a snapshot larger than this")
    # Set by `prepare` at submit: the directory the ranks put first on sys.path (the snapshot).
    code_dir: str | None = None

    @model_validator(mode="after")
    def _one_target(self) -> PythonParams:
        given = [k for k in ("script", "module", "function", "call") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of script, module or function (given: {', '.join(given) or 'none'})"
            )
        if self.function and ":" not in self.function:
            raise ValueError(f"function {self.function!r} must be written package.module:name")
        return self

    @property
    def process_group(self) -> bool:
        """The bootstrap leaves the default group to the user's code (its env:// init)."""
        return False

    @property
    def target(self) -> str:
        """What runs, as a user would type it."""
        if self.script:
            return Path(self.script).name if self.code_dir else self.script
        if self.module:
            return f"-m {self.module}"
        if self.call:
            return str(self.call_name or "the function")
        return str(self.function)

    @property
    def module_name(self) -> str | None:
        """The module to import: ``module``, or the module part of ``function``."""
        if self.module:
            return self.module
        if self.call:
            return self.call_module
        return self.function.partition(":")[0] if self.function else None


@contextmanager
def cwd_on_path(extra: str | None = None) -> Iterator[None]:
    """`python -m` semantics: `extra` (the code snapshot, or the script's folder in it), then the
    working directory, importable while inside; the working directory only where no one else could
    have written a module into it (``hpcdist.files.trust.cwd_problem``)."""
    from hpcdist.files.trust import importable_cwd

    added = [p for p in (extra, *importable_cwd()) if p and p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            if p in sys.path:
                sys.path.remove(p)


def code_root(params: PythonParams) -> tuple[Path, str] | None:
    """The directory to snapshot and the name it keeps inside the copy ('' for its contents).

    A script: its directory. A module: its top-level package (or the directory of a lone
    module file). None when the code is installed (inside the interpreter's prefix) or snapshots
    are off.
    """
    if params.snapshot is False:
        return None
    if isinstance(params.snapshot, str):
        return Path(params.snapshot).resolve(), ""
    if params.script:
        return Path(params.script).resolve().parent, ""
    if not params.module_name:  # a call shipped by value: nothing to import on the nodes
        return None
    top = params.module_name.split(".")[0]
    with cwd_on_path():
        spec = importlib.util.find_spec(top)
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(origin.is_relative_to(p) for p in prefixes):
        return None  # installed code: the nodes have it too
    if spec.submodule_search_locations:
        return origin.parent, top
    return origin.parent, ""


def outputs(job: Job[PythonParams], site: Site) -> list[Path]:
    """Where hpcdist writes, which no code snapshot copies: the site's storage roots and the
    spec's own ``folder`` (a part with the job id, ``log_%j``, stands for each folder it names)."""
    out = list(site.storage.roots)
    if job.spec.folder:
        out.append(Path(job.spec.folder))
    return out


def check(job: Job[PythonParams], site: Site) -> list[Problem]:
    """What makes the target impossible to run, found before anything is queued."""
    from hpcdist.kinds import snapshot

    p = job.params
    if p.code_dir:  # already prepared (a snapshot made at submit); the nodes check again
        return []
    if p.script:
        path = Path(p.script)
        if not path.is_file():
            where = f" (from {os.getcwd()})" if not path.is_absolute() else ""
            return [("params.script", p.script, f"an existing Python file{where}; check the path")]
    if p.module_name and not p.call:  # a call's function was imported by the process that submits it
        problem = _import_problem(p)
        if problem:
            return [problem]
    if isinstance(p.snapshot, str) and not Path(p.snapshot).is_dir():
        return [("params.snapshot", p.snapshot, "an existing directory, true or false")]
    root = code_root(p)
    if root is not None and p.script and not Path(p.script).resolve().is_relative_to(root[0]):
        return [("params.snapshot", str(root[0]), f"a directory holding the script {p.script}, or false")]
    if root is not None:
        size, count = snapshot.measure(root[0], outputs(job, site))
        if size > p.snapshot_max_mb * 1e6:
            return [(
                "params.snapshot", str(root[0]),
                f"a code snapshot under params.snapshot_max_mb={p.snapshot_max_mb:g} MB, but it holds "
                f"{size / 1e6:.1f} MB in {count} files; leave data out (.gitignore it in a git checkout), "
                f"point params.snapshot at the code's own directory, raise params.snapshot_max_mb, "
                f"or set params.snapshot=false",
            )]
    return []


def _import_problem(p: PythonParams) -> Problem | None:
    """The target's import, checked in a child process (``hpcdist.kinds.imports``): a module's
    packages, source and top-level imports; a function's module imported and the name callable."""
    from hpcdist.files.trust import cwd_problem, importable_cwd
    from hpcdist.kinds import imports

    name = p.module_name or ""
    key = "params.module" if p.module else "params.function"
    with cwd_on_path():
        failed: Exception | None = None
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:  # a parent package that does not import
            found, failed = None, exc
        closed = cwd_problem() if found is None else None
        if closed:
            return (key, name, f"an importable module from the installed packages; the current folder is not "
                               f"searched: {closed}, so a module there could be anyone's; submit from a folder "
                               f"of your own (or install the package)")
        if failed is not None:
            return (key, name, f"an importable module; importing it failed: {type(failed).__name__}: {failed}")
        if found is None:
            return (key, name, f"an importable module from {os.getcwd()} or the installed packages; "
                               f"check the name and that its package has an __init__.py")
    report = imports.inspect(module=p.module, function=p.function, path=importable_cwd(), snapshot=None)
    if report.error is None:
        return None
    if p.function:
        joint = ", " if report.error.startswith("but ") else "; "
        return (key, p.function, f"a callable{joint}{report.error}")
    return (key, name, f"a module that imports; {report.error}")


def _warn_live_imports(p: PythonParams, src: Path) -> None:
    """At submit: say which of the code's imports the job will read live from the submit folder."""
    from hpcdist.files.trust import importable_cwd
    from hpcdist.kinds import imports

    path = [str(Path(p.script).resolve().parent)] if p.script else []
    report = imports.inspect(module=None, function=None, path=[*path, *importable_cwd()], snapshot=src)
    for name, where in sorted(report.outside.items()):
        print(
            f"hpcdist: warning: the code imports {name} from {where}, outside the snapshot of {src}: the job "
            f"reads it there, live (an edit after submit changes the job); point params.snapshot at a folder "
            f"holding both, or install it", file=sys.stderr,
        )


def prepare(job: Job[PythonParams], site: Site) -> dict[str, Any]:
    """At submit: the code snapshot made, and the params the ranks run (paths made absolute)."""
    from hpcdist.files.trust import cwd_problem, real_folder
    from hpcdist.kinds import snapshot

    p = job.params
    updates: dict[str, Any] = {"snapshot": False}
    root = code_root(p)
    if p.script:
        updates["script"] = str(Path(p.script).resolve())
    closed = cwd_problem()
    if closed:
        print(f"hpcdist: warning: the current folder is left off the job's import path: {closed}; the job imports "
              f"nothing from it, only from its code snapshot and the installed packages (files it opens by "
              f"relative path are still read there)", file=sys.stderr)
    if root is not None:
        src, keep = root
        _warn_live_imports(p, src)
        made = job.spec.paths(site).new_snapshot()
        dest, left_out = snapshot.make(src, made, keep, p.snapshot_max_mb, outputs(job, site))
        dest = real_folder(dest)  # the ranks import from the path checked now: a link repointed later changes nothing
        if left_out:
            names = ", ".join(f"{rel} ({why})" for rel, why in sorted(left_out.items()))
            print(f"hpcdist: warning: the code snapshot of {src} leaves out {names}; the job cannot read "
                  f"them there (pass secrets with env_passthrough)", file=sys.stderr)
        updates["code_dir"] = str(dest)
        if p.script:
            updates["script"] = str(dest / Path(p.script).resolve().relative_to(src))
    return updates


def wants_context(fn: Callable[..., Any]) -> bool:
    """Whether `fn`'s first parameter is annotated ``hpcdist.Context`` (as the class or, under
    ``from __future__ import annotations``, as its name): such a function gets the group."""
    import inspect

    try:
        first = next(iter(inspect.signature(fn).parameters.values()), None)
    except (TypeError, ValueError):
        return False
    if first is None:
        return False
    note = first.annotation
    if isinstance(note, str):
        return note in ("hpcdist.Context", "Context", "hpcdist.api.Context")
    return getattr(note, "__name__", None) == "Context" and str(getattr(note, "__module__", "")).startswith("hpcdist")

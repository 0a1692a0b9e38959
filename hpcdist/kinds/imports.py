"""What the user's code imports, checked at submit in a child process with a timeout.

Two questions, answered without running the user's program on the login node:

- does the target import? A ``params.module``'s parent packages are imported (as ``python -m``
  does on the nodes), its source is compiled, and every import at its top level must be found;
  its body is not run, since the body of a ``-m`` module is the program. A ``params.function``'s
  module is imported for real (it is a library: the function is the program) and the name must
  be callable.
- which top-level imports of the code resolve outside the snapshot but in a folder that stays
  on ``sys.path`` on the nodes (the submit folder): those files are read live by the job, not
  frozen, so an edit after submit changes it.

The child keeps a broken or slow import (a hang, ``sys.exit``, a segfault) out of ``hpcdist
submit``. Standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpcdist.launchers import SAFE_PATH

TIMEOUT_S = 60.0


@dataclass
class Report:
    """What the child found: `error` (one line) when the target cannot run; `outside`: import
    name -> where it resolves, for imports found in `path` but outside the snapshot."""

    error: str | None = None
    outside: dict[str, str] = field(default_factory=dict)


def inspect(*, module: str | None, function: str | None, path: list[str], snapshot: Path | None,
            timeout_s: float = TIMEOUT_S) -> Report:
    """Run the checks in a child interpreter (this one) with `path` first on ``sys.path``."""
    request = {"module": module, "function": function, "path": path,
               "snapshot": str(snapshot) if snapshot else None}
    try:
        proc = subprocess.run(
            [sys.executable, *SAFE_PATH, "-c", _CHILD, json.dumps(request)],  # only `path` first on sys.path
            capture_output=True, text=True, timeout=timeout_s, check=False,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
    except subprocess.TimeoutExpired:
        what = module or function
        return Report(error=f"importing {what} did not finish within {timeout_s:g} s at submit; "
                            f"make its import fast (no work at import time)")
    lines = proc.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return Report(error=f"the import check ended with code {proc.returncode}: {tail}")
    return Report(error=found.get("error"), outside=dict(found.get("outside", {})))


# The child: argv[1] is the request as JSON; its last stdout line is the report as JSON.
_CHILD = r'''
import ast, importlib, importlib.util, json, os, sys

req = json.loads(sys.argv[1])
sys.path[:0] = [p for p in req["path"] if p not in sys.path]
out = {"error": None, "outside": {}}
live = [os.path.realpath(p) for p in req["path"]]  # the folders the nodes import from as they are

def first(exc):
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else '(no message)'}"

def top_imports(tree, package):
    """Absolute names imported by statements directly in the module body (not in try/if/def)."""
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                if not base:
                    continue
                names.append((f"{base}.{node.module}" if node.module else base, node.lineno))
            elif node.module:
                names.append((node.module, node.lineno))
    return names

def where(name):
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        return None
    if spec is None:
        return None
    return spec.origin or next(iter(spec.submodule_search_locations or []), None) or "namespace"

def check_module(name):
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        try:
            importlib.import_module(parent)
        except BaseException as exc:
            return f"its package {parent} does not import: {first(exc)}"
    try:
        spec = importlib.util.find_spec(name)
    except BaseException as exc:
        return f"finding it failed: {first(exc)}"
    if spec is None:
        return "no such module"
    origin = spec.origin
    package = name if spec.submodule_search_locations else name.rpartition(".")[0]
    if spec.submodule_search_locations:  # python -m pkg runs pkg.__main__
        main = importlib.util.find_spec(name + ".__main__")
        if main is None:
            return f"{name} is a package without a __main__ module"
        origin = main.origin
    if not origin or not origin.endswith(".py"):
        return None
    try:
        source = open(origin, "rb").read()
        tree = ast.parse(source, origin)
        compile(tree, origin, "exec")
    except SyntaxError as exc:
        return f"SyntaxError: {exc.msg} ({origin}, line {exc.lineno})"
    for imported, line in top_imports(tree, package):
        try:
            found = importlib.util.find_spec(imported)
        except BaseException as exc:
            return f"it imports {imported} (line {line}), which does not import: {first(exc)}"
        if found is None:
            return f"it imports {imported} (line {line}), which is not installed or not found"
    return None

if req["module"]:
    problem = check_module(req["module"])
    if problem:
        out["error"] = problem
elif req["function"]:
    mod, _, attr = req["function"].partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except BaseException as exc:
        out["error"] = f"importing {mod} failed: {first(exc)}"
    else:
        if not callable(obj):
            out["error"] = f"but {attr} is a {type(obj).__name__}"

snap = req["snapshot"]
if snap and not out["error"]:
    snap = os.path.realpath(snap)
    seen = set()
    for dirpath, dirnames, filenames in os.walk(snap):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
        for fname in filenames:
            if not fname.endswith(".py"):
                continue
            try:
                tree = ast.parse(open(os.path.join(dirpath, fname), "rb").read())
            except (SyntaxError, ValueError, OSError):
                continue
            for imported, _ in top_imports(tree, ""):
                seen.add(imported.split(".")[0])
    for top in sorted(seen):
        if top in sys.builtin_module_names or top in sys.stdlib_module_names:
            continue
        origin = where(top)
        if origin in (None, "built-in", "frozen", "namespace"):
            continue
        real = os.path.realpath(origin)
        if real == snap or real.startswith(snap + os.sep):
            continue
        entry = os.path.dirname(os.path.dirname(real) if real.endswith("__init__.py") else real)
        if top == "hpcdist" or entry not in live:
            continue  # found through another sys.path entry (installed code), or hpcdist itself
        out["outside"][top] = os.path.dirname(real) if real.endswith("__init__.py") else real
print(json.dumps(out))
'''

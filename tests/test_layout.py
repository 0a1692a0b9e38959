"""The layout follows the flow, read from the source: no import circle, nothing on the nodes
importing the login side, one owner for Slurm's commands, and modules of a readable size.

Imports are read with ``ast`` from every module of the package, type-only imports (under
``if TYPE_CHECKING:``) and imports inside functions included: a circle through a function's
import is still two modules that each need the other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.cli import REPO

PACKAGE = REPO / "hpcdist"
# The login side: what runs before anything is queued, and after (never imported on the nodes).
# The two sides and what both use. The login side runs where the user submits, before a job is
# queued and after; the node side runs in every rank; the shared packages serve both and import
# neither side. Only the command line (and the package root's lazy exports) may reach both.
LOGIN = ("hpcdist.login",)
NODE = ("hpcdist.runtime", "hpcdist.api", "hpcdist.store", "hpcdist.train", "hpcdist.infer", "hpcdist.bench",
        "hpcdist.kinds", "hpcdist.model", "hpcdist.data", "hpcdist.track")
SHARED = ("hpcdist.config", "hpcdist.files", "hpcdist.scheduler", "hpcdist.launchers", "hpcdist.containers",
          "hpcdist.console", "hpcdist.errors", "hpcdist._version", "hpcdist.polling", "hpcdist.progress",
          "hpcdist._paths")
# The store is the end of the node side's flow and what the login side reads back (results,
# checkpoints, the health record, the job's records): it imports the shared packages only.
STORE = ("hpcdist.store",)
# Modules over the size limit must say why in their docstring ("over 400 lines: ...").
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports (the longest known prefix of each import)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)  # a parent package's __init__ is where a child lives, not an import
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def side(name: str) -> str:
    if name == "hpcdist" or name == "hpcdist.cli" or name.startswith("hpcdist.cli."):
        return "top"
    for label, prefixes in (("login", LOGIN), ("node", NODE), ("shared", SHARED)):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return label
    raise AssertionError(f"{name} is on no side: add it to LOGIN, NODE or SHARED in tests/test_layout.py")


def test_every_module_is_on_one_side() -> None:
    assert sorted({side(name) for name in modules()}) == ["login", "node", "shared", "top"]


def test_node_side_never_imports_the_login_side() -> None:
    wrong = sorted(f"{a} -> {b}" for a, targets in graph().items() if side(a) == "node"
                   for b in targets if side(b) in ("login", "top"))
    assert wrong == []


def test_shared_packages_import_neither_side() -> None:
    """What both sides use runs no side's code: an import from config, scheduler, launchers,
    console or progress into runtime, a job or the login side runs back up the flow."""
    wrong = sorted(f"{a} -> {b}" for a, targets in graph().items() if side(a) == "shared"
                   for b in targets if side(b) != "shared" and not b.startswith(STORE))
    assert wrong == []


def test_the_store_imports_only_shared_packages() -> None:
    wrong = sorted(f"{a} -> {b}" for a, targets in graph().items() if a.startswith(STORE)
                   for b in targets if side(b) != "shared" and not b.startswith(STORE))
    assert wrong == []


# The store's concerns (issue 42): each folder imports the store's shared modules and only the
# folders its concern builds on (sharded state on the checkpoint format, results on its HDF5 tree).
STORE_SHARED = ("hpcdist.store.checksum", "hpcdist.store.hostmem")
STORE_FOLDERS = {
    "hpcdist.store.checkpoint": (),
    "hpcdist.store.sharded": ("hpcdist.store.checkpoint",),
    "hpcdist.store.results": ("hpcdist.store.checkpoint.tree", "hpcdist.store.records"),
    "hpcdist.store.records": (),
}


def test_each_store_folder_imports_only_what_its_concern_builds_on() -> None:
    wrong = []
    for a, targets in graph().items():
        folder = next((f for f in STORE_FOLDERS if a == f or a.startswith(f + ".")), None)
        if folder is None:
            continue
        allowed = (folder, *STORE_SHARED, *STORE_FOLDERS[folder])
        wrong += [f"{a} -> {b}" for b in targets if b.startswith(STORE) and b != "hpcdist.store"
                  and not any(b == x or b.startswith(x + ".") for x in allowed)]
    assert sorted(wrong) == []


# What a rank starts from: the runners and params models the kinds' registry names, the modules
# the launchers' and the batch script's lines run (``python -m ...``), and ``hpcdist.init()``.
RANK_ENTRIES = ("hpcdist.runtime", "hpcdist.runtime.entry", "hpcdist.runtime.task_runner", "hpcdist.runtime.task_ids",
                "hpcdist.runtime.agent", "hpcdist.runtime.local_controller", "hpcdist.runtime.node_failure",
                "hpcdist.runtime.requeue", "hpcdist.runtime.in_job", "hpcdist.runtime.standby", "hpcdist.api")
# Modules of the node side's packages that no rank imports, each with why it lives there and not in
# hpcdist/login: a reader on the login side kept beside the writer that owns the format.
LOGIN_ONLY_ON_THE_NODE_SIDE = {
    "hpcdist.bench.report": "`hpcdist report`'s benchmark tables and plots, beside the result file bench/record writes",
    "hpcdist.infer.report": "`hpcdist report`'s inference summary, beside the result file infer/results writes",
    "hpcdist.store.results.compare": "`hpcdist report --compare`, beside the result format it reads",
    "hpcdist.model.hf": "`hpcdist model import/export` (Hugging Face folders), beside the models whose weights it maps",
    "hpcdist.model.hf_llama": "the LLaMA half of `hpcdist model`, beside the model it maps",
    "hpcdist.store.sharded.dcp": "`hpcdist ckpt` to and from DCP folders, beside the sharded format",
    "hpcdist.infer.hf": "the Hugging Face reference generation the tests and benchmarks compare against",
    "hpcdist.infer.sizing": "on-paper tensor-parallel costs for the benchmarks and tests (no torch)",
}


def rank_side() -> set[str]:
    """Every module a rank can import, from `RANK_ENTRIES` and each kind's runner and params model."""
    edges = graph()
    registry = (PACKAGE / "kinds" / "registry.py").read_text()
    kinds = re.findall(r'JobKind\(\s*"\w+",\s*"([\w.]+):\w+",\s*"([\w.]+):\w+"', registry)  # params, runner
    assert len(kinds) >= 8, "the registry's JobKind lines are no longer read: mend this pattern"
    todo = [*RANK_ENTRIES, *(m for pair in kinds for m in pair)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += edges.get(name, ())
    return seen


def test_the_node_side_packages_hold_what_ranks_run() -> None:
    """Both ways: no rank imports the login side (above), and a module in a node-side package is one
    a rank can import, or a listed exception whose reason says why it lives there."""
    ranks = rank_side()
    node = [n for n, p in modules().items() if side(n) == "node" and p.name != "__init__.py"]
    assert sorted(n for n in node if n not in ranks and n not in LOGIN_ONLY_ON_THE_NODE_SIDE) == []
    assert sorted(n for n in LOGIN_ONLY_ON_THE_NODE_SIDE if n in ranks or n not in node) == []  # the list stays true


def test_the_login_side_imports_no_command() -> None:
    wrong = sorted(f"{a} -> {b}" for a, targets in graph().items() if side(a) == "login"
                   for b in targets if b.startswith("hpcdist.cli"))
    assert wrong == []


def test_every_package_says_what_it_owns_and_where_it_runs() -> None:
    vague = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = (ast.get_docstring(ast.parse(init.read_text())) or "").lower()
        if not doc or not any(word in doc for word in ("login side", "node side", "both sides", "rank side",
                                                       "on the nodes", "every rank")):
            vague.append(module_name(init))
    assert vague == []


SLURM_COMMAND = re.compile(r"""["'](sbatch|squeue|sacct|scontrol|scancel|sinfo)["']""")


def test_only_the_scheduler_runs_slurm_commands() -> None:
    """A Slurm command named as a program to run appears in hpcdist.scheduler only (shell lines
    rendered into the batch script are text for the nodes, not calls)."""
    outside = []
    for name, path in modules().items():
        if name.startswith("hpcdist.scheduler"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SLURM_COMMAND.search(line) and ("[" in line or "run(" in line):
                outside.append(f"{name}:{number}: {line.strip()}")
    assert outside == []


def test_modules_are_of_a_readable_size_or_say_why() -> None:
    long = []
    for name, path in modules().items():
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and "lines:" not in doc:
            long.append(f"{name}: {lines} lines")
    assert long == []


# torch's collectives that pickle on the sender and unpickle on every receiver (issue 54 item 4)
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "broadcast_object", "recv_object_list", "send_object_list")


def test_no_rank_unpickles_what_another_sends() -> None:
    """Plain data between ranks goes through ``hpcdist.runtime.plain`` (JSON in tensors): a call or
    a reference to one of torch's object collectives anywhere in the package is refused, so the
    next exchange someone adds cannot let a process on the job's store run code as the user."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            named = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if isinstance(node, ast.alias):
                named = node.name.rpartition(".")[2]
            if named in OBJECT_COLLECTIVES:
                found.append(f"{name}:{getattr(node, 'lineno', 0)}: {named}")
    assert found == []


def test_one_checkpoint_saved_and_resumed_enters_no_module_more_than_twice() -> None:
    """docs/layout.md's figure: train_gpt's save to its commit and back through the resume's load,
    traced by the command the page prints; it exits 1 naming any module entered three times."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "checkpoint_trace.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "over 2: none" in done.stdout

"""The registry of job kinds, by name; a duplicate name is an error.

A kind's params model is light (pydantic only) so the login node validates a spec without
importing torch; the runner is a ``module:function`` string imported on the nodes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec

# Modules that register the built-in kinds when imported.
BUILTIN_MODULES: tuple[str, ...] = (
    "hpcdist.jobs.smoke",
    "hpcdist.bench.jobs",
    "hpcdist.train.params",
    "hpcdist.infer.jobs",
)

Problem = tuple[str, object, str]


@dataclass(frozen=True)
class JobKind:
    name: str
    params: type[BaseModel]
    runner: str  # "package.module:function", called as function(ctx, params) on every rank
    summary: str
    # Site-dependent checks done before anything is launched: (key path, value, what to do).
    check: Callable[[JobSpec, Site], list[Problem]] | None = None
    # Whether the ranks need MPI (mpi4py initialised before the process group).
    uses_mpi: Callable[[Any], bool] = lambda params: False

    def load_runner(self) -> Callable[..., dict[str, Any] | None]:
        module, _, func = self.runner.partition(":")
        runner: Callable[..., dict[str, Any] | None] = getattr(importlib.import_module(module), func)
        return runner


_KINDS: dict[str, JobKind] = {}
_loaded = False


def register(kind: JobKind) -> JobKind:
    if kind.name in _KINDS:
        raise ValueError(f"job kind {kind.name!r} is registered twice ({_KINDS[kind.name].runner}, {kind.runner})")
    _KINDS[kind.name] = kind
    return kind


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def get_kind(name: str) -> JobKind:
    _load_builtins()
    return _KINDS[name]


def kind_names() -> list[str]:
    _load_builtins()
    return sorted(_KINDS)

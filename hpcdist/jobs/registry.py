"""The registry of job kinds, by name, and the resolution of a spec into a typed ``Job``.

A kind is three ``module:name`` references, imported only when needed: its params model (a
light module, pydantic only), its site check (login node) and its runner (the nodes). So
listing the kinds imports nothing, and rendering a smoke job never imports the training,
benchmark or inference code. A duplicate name is an error.

``resolve`` parses a spec's params once per side into the kind's model; checks, the
bootstrap and the runner take the resulting ``Job`` and never validate the dict again.
The registry depends on ``hpcdist.config`` (YAML, JobSpec, fitting to the site), never the reverse.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel

from hpcdist.config import check_fits, read_spec, validate
from hpcdist.config.spec import JobSpec
from hpcdist.errors import ConfigError

if TYPE_CHECKING:
    from hpcdist.config.site import Site

Problem = tuple[str, object, str]  # (key path, value, what is allowed or what to do)
P = TypeVar("P", bound=BaseModel)


def _load(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class JobKind:
    """A job kind: its name and where its pieces live, as ``package.module:name`` strings."""

    name: str
    params: str  # the params model, in a module that imports pydantic only
    runner: str  # called as runner(ctx, params) on every rank
    summary: str
    # Site-dependent checks done before anything is launched: check(job, site) -> problems.
    check: str | None = None
    # At submit only (never render): prepare(job, site) -> params updates (e.g. a code snapshot).
    prepare: str | None = None

    def params_model(self) -> type[BaseModel]:
        model: type[BaseModel] = _load(self.params)
        return model

    def load_runner(self) -> Callable[..., dict[str, Any] | None]:
        runner: Callable[..., dict[str, Any] | None] = _load(self.runner)
        return runner

    def load_check(self) -> Callable[[Job[Any], Site], list[Problem]] | None:
        return None if self.check is None else _load(self.check)


@dataclass(frozen=True)
class Job(Generic[P]):
    """A spec with its params parsed by its kind's model: what every later stage takes."""

    spec: JobSpec
    kind: JobKind
    params: P

    @property
    def uses_mpi(self) -> bool:
        """Whether the ranks need mpi4py initialised before the process group (a params model
        says so with a ``uses_mpi`` property)."""
        return bool(getattr(self.params, "uses_mpi", False))

    @property
    def makes_group(self) -> bool:
        """Whether the bootstrap makes the default process group (the ``python`` kind leaves it
        to the user's code; a params model says so with a ``process_group`` property)."""
        return bool(getattr(self.params, "process_group", True))


_KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> JobKind:
    if kind.name in _KINDS:
        raise ValueError(f"job kind {kind.name!r} is registered twice ({_KINDS[kind.name].runner}, {kind.runner})")
    _KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> JobKind:
    return _KINDS[name]


def kind_names() -> list[str]:
    return sorted(_KINDS)


def resolve(spec: JobSpec, site: Site, *, origin: Path | str = "job spec", check: bool = True) -> Job[Any]:
    """`spec` as a ``Job``: its kind looked up, its params parsed once, and (login side) the
    kind's own checks against `site`. Every problem is one ConfigError naming `origin`."""
    try:
        kind = get_kind(spec.kind)
    except KeyError:
        raise ConfigError(
            f"{origin}: kind: unknown job kind {spec.kind!r}; known kinds: {', '.join(kind_names())}"
        ) from None
    job = Job(spec, kind, validate(kind.params_model(), spec.params, origin, prefix=("params",)))
    if check:
        check_fits(spec, site, origin)
        kind_check = kind.load_check()
        problems = kind_check(job, site) if kind_check is not None else []
        for key, value, allowed in problems:
            raise ConfigError(f"{origin}: {key}: {value!r} cannot run on site {site.name!r}; {allowed}")
    return job


def prepare(job: Job[Any], site: Site) -> Job[Any]:
    """`job` as it is submitted: the kind's submit-time step done (the ``python`` kind's code
    snapshot), its params parsed again with the updates."""
    from hpcdist.store.atomic import storage_umask

    if job.kind.prepare is None:
        return job
    with storage_umask(site.storage.umask):  # what it writes to shared storage gets storage.mode
        updates = _load(job.kind.prepare)(job, site)
    spec = job.spec.model_copy(update={"params": {**job.spec.params, **updates}})
    return resolve(spec, site, origin="prepared job", check=False)


def load_job(path: str | Path, site: Site, overrides: list[str] | None = None) -> Job[Any]:
    """A job spec file read, its params parsed, and checked against `site`: what render and submit take."""
    return resolve(read_spec(path, overrides), site, origin=Path(path))


for _kind in (
    JobKind("smoke", "hpcdist.jobs.smoke:SmokeParams", "hpcdist.jobs.smoke:run",
            "all-reduce of the ranks, checked; writes bootstrap timings"),
    JobKind("bench_collectives", "hpcdist.bench.jobs:CollectivesParams", "hpcdist.bench.collectives:run",
            "collectives over a sweep of sizes (nccl-tests figures), HDF5 result",
            check="hpcdist.bench.jobs:check_collectives"),
    JobKind("bench_p2p", "hpcdist.bench.jobs:P2PParams", "hpcdist.bench.p2p:run",
            "ping-pong latency, uni- and bidirectional bandwidth between two ranks",
            check="hpcdist.bench.jobs:check_p2p"),
    JobKind("bench_pairs", "hpcdist.bench.jobs:PairsParams", "hpcdist.bench.pairs:run",
            "bandwidth and latency of every node pair, as a matrix",
            check="hpcdist.bench.jobs:check_pairs"),
    JobKind("bench_preflight", "hpcdist.bench.jobs:PreflightParams", "hpcdist.bench.preflight:run",
            "seconds-long check against the site's minimums; fails naming the short nodes",
            check="hpcdist.bench.jobs:check_preflight"),
    JobKind("train_gpt", "hpcdist.train.params:TrainParams", "hpcdist.train.loop:run",
            "data-parallel GPT training with HDF5 checkpoints that survive preemption",
            check="hpcdist.train.params:check"),
    JobKind("infer_gpt", "hpcdist.infer.jobs:InferParams", "hpcdist.infer.run:run_infer",
            "load a GPT checkpoint (broadcast or TP shards), generate for a prompt file, time it",
            check="hpcdist.infer.jobs:check_infer"),
    JobKind("broadcast", "hpcdist.infer.jobs:BroadcastParams", "hpcdist.infer.run:run_broadcast",
            "flat-bucket broadcast of a model-sized state from rank 0, timed and checked",
            check="hpcdist.infer.jobs:check_broadcast"),
    JobKind("python", "hpcdist.jobs.python:PythonParams", "hpcdist.jobs.python_run:run",
            "your own script, module or function, started as torchrun would start it",
            check="hpcdist.jobs.python:check", prepare="hpcdist.jobs.python:prepare"),
):
    register(_kind)

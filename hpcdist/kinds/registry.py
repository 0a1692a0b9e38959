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
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from hpcdist.config import apply_overrides, check_fits, read_yaml, validate
from hpcdist.config.spec import JobSpec, SpecPath
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
    # When a node dies, what a spec without `on_node_failure` asks for: a run that resumes from
    # its checkpoints at another world size can go on without the node; others end.
    on_node_failure: Literal["requeue", "fail"] = "fail"

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


def on_node_failure(spec: JobSpec) -> Literal["requeue", "fail"]:
    """What the job does when one of its nodes dies: the spec's word, else its kind's default."""
    if spec.on_node_failure is not None:
        return spec.on_node_failure
    return _KINDS[spec.kind].on_node_failure if spec.kind in _KINDS else "fail"


Warn = Callable[[str], None]


def resolve(spec: JobSpec, site: Site, *, origin: Path | str = "job spec", check: bool = True,
            on_missing: Warn | None = None, made_earlier: Collection[Path] = ()) -> Job[Any]:
    """`spec` as a ``Job``: its kind looked up, its params parsed once, and (login side) the
    kind's own checks against `site`. Every problem is one ConfigError naming `origin`.

    An input file that is not there is an error, or with `on_missing` (``render``) a warning
    passed to it; either way the kind's checks, which read the inputs, are skipped. Paths in
    `made_earlier` (what an earlier job of a chain writes) are expected to be missing."""
    try:
        kind = get_kind(spec.kind)
    except KeyError:
        raise ConfigError(
            f"{origin}: kind: unknown job kind {spec.kind!r}; known kinds: {', '.join(kind_names())}"
        ) from None
    job = Job(spec, kind, validate(kind.params_model(), spec.params, origin, prefix=("params",)))
    if check:
        check_fits(spec, site, origin)
        absent, unseen, seen_on = missing_inputs(job, site), list[Any](), ""
        if absent and site.scheduler == "slurm":  # `--on HOST`: the inputs are the cluster's, asked on its login node
            from hpcdist.scheduler import ssh

            if ssh.login():
                there, seen_on = ssh.missing([a[2] for a in absent]), f" on {ssh.login()}"
                unseen = [a for a in absent if a[2] in there]
        for key, value, path, hint in [a for a in (unseen if seen_on else absent) if a[2] not in made_earlier]:
            message = f"{origin}: {key}: {value!r} does not exist{seen_on}" + (
                f" ({path})" if str(path) != value else "")
            if on_missing is None:
                where = "the spec file's folder, or the current one when given with --set" if isinstance(
                    origin, Path) else "the current folder"
                raise ConfigError(f"{message}; {hint or 'create it'}, or fix the path (a relative one is read "
                                  f"from {where})")
            on_missing(f"{message}{'' if seen_on else ' here'}; the job fails unless it exists where it runs "
                       f"({hint or 'create it'})")
        if absent:
            return job  # the kind's checks read the inputs: they run on the nodes instead
        kind_check = kind.load_check()
        problems = kind_check(job, site) if kind_check is not None else []
        for key, seen, allowed in problems:
            raise ConfigError(f"{origin}: {key}: {seen!r} cannot run on site {site.name!r}; {allowed}")
    return job


def prepare(job: Job[Any], site: Site) -> Job[Any]:
    """`job` as it is submitted: the kind's submit-time step done (the ``python`` kind's code
    snapshot), its params parsed again with the updates."""
    from hpcdist.files import roots
    from hpcdist.files.atomic import storage_umask

    with storage_umask(site.storage.umask):
        roots.ready(site.storage, site.name)  # roots she may use; <root>/<user> her own, or one line saying why not
    if job.kind.prepare is None:
        return job
    with storage_umask(site.storage.umask):  # what it writes to shared storage gets storage.mode
        updates = _load(job.kind.prepare)(job, site)
    spec = job.spec.model_copy(update={"params": {**job.spec.params, **updates}})
    return resolve(spec, site, origin="prepared job", check=False)


def load_job(path: str | Path, site: Site, overrides: list[str] | None = None, *,
             on_missing: Warn | None = None, made_earlier: Collection[Path] = ()) -> Job[Any]:
    """A job spec file read, its paths resolved, its params parsed, and checked against `site`:
    what render and submit take (`on_missing`, `made_earlier`: as ``resolve``)."""
    return load_jobs(path, site, overrides, on_missing=on_missing, made_earlier=made_earlier)[0]


def load_jobs(path: str | Path, site: Site, overrides: list[str] | None = None,
              variants: Sequence[Sequence[str]] = ((),), *, on_missing: Warn | None = None,
              made_earlier: Collection[Path] = ()) -> list[Job[Any]]:
    """One job per variant (a sweep task's own overrides), the file read once: its relative
    paths resolved against its folder, then the overrides applied (their paths against the
    current folder), the spec validated, its params parsed and the job checked against `site`."""
    path = Path(path)
    try:
        if not path.is_file():
            raise ConfigError(f"job spec {str(path)!r} does not exist")
    except PermissionError as exc:  # a folder above it this user cannot enter
        raise ConfigError(f"job spec {str(path)!r} cannot be read ({exc.strerror}: a folder above it is not "
                          f"open to you); copy it somewhere you can read, or ask its owner to open the folder") from exc
    data = rebase_paths(read_yaml(path), path.resolve().parent, site)
    jobs = []
    for extra in variants:
        sets = [*(overrides or []), *extra]
        varied = rebase_paths(apply_overrides(data, sets, "job"), Path.cwd(), site) if sets else data
        jobs.append(resolve(validate(JobSpec, varied, path), site, origin=path, on_missing=on_missing,
                            made_earlier=made_earlier))
    return jobs


def path_fields(model: type[BaseModel]) -> dict[str, SpecPath]:
    """The params fields a kind's model marks as paths (``Annotated[..., SpecPath()]``)."""
    return {name: marks[0] for name, field in model.model_fields.items()
            if (marks := [m for m in field.metadata if isinstance(m, SpecPath)])}


def rebase_paths(data: dict[str, Any], folder: Path, site: Site) -> dict[str, Any]:
    """`data` (a spec mapping) with each relative path of its kind's path fields made absolute
    against `folder`; one ``SpecPath.site_root`` marks is resolved once by ``site_relative``."""
    if data.get("kind") not in _KINDS or not isinstance(data.get("params"), dict):
        return data
    params = dict(data["params"])
    for name, mark in path_fields(get_kind(data["kind"]).params_model()).items():
        value = params.get(name)
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        params[name] = (site_relative(f"params.{name}", value, folder, site, mark.site_root)
                        if mark.site_root is not None else os.path.normpath(folder / value))
    return {**data, "params": params}


def site_relative(key: str, value: str, folder: Path, site: Site, root: Literal["checkpoints", "results"]) -> str:
    """A relative `value` of a field that names something under this user's storage `root` (a
    checkpoint): that entry when it exists; else the one beside the spec (`folder`) when that
    folder is the user's own (no one else may write it or a folder above it: a colleague's
    ``train_gpt/`` beside her spec is not what her job loads); else left relative, for the job's
    storage alone (an earlier job of a chain writes it). Where both exist, or the one beside the
    spec is refused, one warning names what is used."""
    from hpcdist.files.trust import problem

    stored, beside = site.storage.root(root) / value, folder / value
    if not beside.exists():
        return str(stored) if stored.exists() else value
    why = problem(folder)
    if why is None and not stored.exists():
        return os.path.normpath(beside)
    import logging

    ignored = f"not {beside}, which is also there" if why is None else f"not {beside}: {why}"
    logging.getLogger("hpcdist").warning("%s: %r is %s, %s", key, value, stored if stored.exists() else
                                         f"looked up in {stored} on the nodes", ignored)
    return str(stored) if stored.exists() else value


def missing_inputs(job: Job[Any], site: Site) -> list[tuple[str, str, Path, str]]:
    """Each required input path of `job` that is not there: (key, value, where it was looked
    for, how to make it)."""
    out = []
    for name, mark in path_fields(job.kind.params_model()).items():
        value = job.spec.params.get(name)
        if not mark.required or not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        if mark.site_root is not None and not path.is_absolute():
            path = site.storage.root(mark.site_root) / path  # never the current folder (site_relative)
        if not path.exists():
            out.append((f"params.{name}", value, path, mark.hint))
    return out


for _kind in (
    JobKind("smoke", "hpcdist.kinds.smoke:SmokeParams", "hpcdist.kinds.smoke:run",
            "all-reduce of the ranks, checked; writes bootstrap timings"),
    JobKind("bench_collectives", "hpcdist.bench.params:CollectivesParams", "hpcdist.bench.collectives:run",
            "collectives over a sweep of sizes (nccl-tests figures), HDF5 result",
            check="hpcdist.bench.params:check_collectives"),
    JobKind("bench_p2p", "hpcdist.bench.params:P2PParams", "hpcdist.bench.p2p:run",
            "ping-pong latency, uni- and bidirectional bandwidth between two ranks",
            check="hpcdist.bench.params:check_p2p"),
    JobKind("bench_pairs", "hpcdist.bench.params:PairsParams", "hpcdist.bench.pairs:run",
            "bandwidth and latency of every node pair, as a matrix",
            check="hpcdist.bench.params:check_pairs"),
    JobKind("bench_preflight", "hpcdist.bench.params:PreflightParams", "hpcdist.bench.preflight:run",
            "seconds-long check against the site's minimums; fails naming the short nodes",
            check="hpcdist.bench.params:check_preflight"),
    JobKind("train_gpt", "hpcdist.train.params:TrainParams", "hpcdist.train.loop:run",
            "data-parallel GPT training with HDF5 checkpoints that survive preemption",
            check="hpcdist.train.params:check", on_node_failure="requeue"),
    JobKind("infer_gpt", "hpcdist.infer.params:InferParams", "hpcdist.infer.run:run_infer",
            "load a GPT checkpoint (broadcast or TP shards), generate for a prompt file, time it",
            check="hpcdist.infer.params:check_infer"),
    JobKind("broadcast", "hpcdist.infer.params:BroadcastParams", "hpcdist.infer.run:run_broadcast",
            "flat-bucket broadcast of a model-sized state from rank 0, timed and checked",
            check="hpcdist.infer.params:check_broadcast"),
    JobKind("python", "hpcdist.kinds.python:PythonParams", "hpcdist.kinds.python_run:run",
            "your own script, module or function, started as torchrun would start it",
            check="hpcdist.kinds.python:check", prepare="hpcdist.kinds.python:prepare"),
):
    register(_kind)

"""``hpcdist.Executor``: submit a Python function from Python (a script, a notebook) and get every
rank's return value back, with hpcdist's site, launcher, process group and checkpoints.

    ex = hpcdist.Executor(site="mycluster", nodes=2, tasks_per_node=4, time_min=60)
    job = ex.submit(train, config, lr=3e-4)   # train(config, lr=3e-4) on every rank, group ready
    job.result()                              # rank 0's return value (waits); job.results(): every rank's
    jobs = ex.map_array(evaluate, items)      # one job array, a job per item

The executor is a job spec of the ``python`` kind built from keywords: the resources
(``nodes``, ``tasks_per_node``, ``gpus_per_node``, ...) and the spec's other keys as keywords,
anything deeper as ``set={"env.X": ..., "site.launcher.kind": "mpirun"}``, or a whole base spec
(``spec=`` a YAML path or a dict). It is validated at construction exactly as a YAML spec is,
with the same one-line ``ConfigError``s, before anything is queued.

The call travels as a cloudpickle file (mode 0600) in the job's log folder: a function from
``__main__`` or a notebook by value, one from an importable module by reference, with its
package's code snapshot on the nodes as the ``python`` kind takes it. Each rank runs it after
hpcdist's bootstrap and ``hpcdist.init()``; see ``hpcdist.jobs.python_run``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.paths import JobPaths
from hpcdist.errors import ConfigError

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.jobs.registry import Job
    from hpcdist.login.jobhandle import JobHandle
    from hpcdist.login.jobindex import JobRecord

ORIGIN = "hpcdist.Executor"


class Executor:
    """Submits functions to a site as jobs of every rank; see the module's docstring."""

    def __init__(self, site: str | None = None, *, spec: str | Path | Mapping[str, Any] | None = None,
                 set: Mapping[str, Any] | None = None, **keys: Any) -> None:  # noqa: A002 (submitit's name)
        from hpcdist.config import load_site

        self._site_sets = [f"{k[len('site.'):]}={_yaml(v)}" for k, v in (set or {}).items() if k.startswith("site.")]
        self.site: Site = load_site(site, self._site_sets)
        self._data = _spec_data(_base(spec), keys, set or {})
        self._check(self._data)  # every key checked now, with a stand-in function

    def update_parameters(self, **keys: Any) -> None:
        """Change resources or spec keys for later submissions (submitit's name); checked now."""
        data = _spec_data(self._data, keys, {})
        self._check(data)
        self._data = data

    def _check(self, data: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> Job[Any]:
        """The job as a YAML spec of it would be resolved: one ConfigError for the first problem."""
        from hpcdist.config import validate
        from hpcdist.config.spec import JobSpec
        from hpcdist.jobs.registry import resolve

        full = {"name": "function", **data, "kind": "python",
                "params": {**data.get("params", {}), **(params or {"function": "builtins:print"})}}
        return resolve(validate(JobSpec, full, ORIGIN), self.site, origin=ORIGIN)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> JobHandle:
        """Run ``fn(*args, **kwargs)`` on every rank of one job; its handle, at once."""
        return self._submit_all(fn, [(args, kwargs)], array=False)[0]

    def map_array(self, fn: Callable[..., Any], *iterables: Iterable[Any], max_parallel: int | None = None
                  ) -> list[JobHandle]:
        """One job array, a job per item: ``fn(a, b, ...)`` for each tuple of the iterables'
        items (submitit's shape: a list of jobs, not of results). `max_parallel` tasks at a time.
        On the local site, with no scheduler, each item is a job of its own."""
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [(tuple(i), {}) for i in zip(*iterables, strict=True)]
        if not calls:
            return []
        if max_parallel is not None and max_parallel < 1:
            raise ConfigError(f"hpcdist.Executor.map_array: max_parallel={max_parallel}; give at least 1, or None")
        return self._submit_all(fn, calls, array=True, max_parallel=max_parallel)

    def _submit_all(self, fn: Callable[..., Any], calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
                    array: bool, max_parallel: int | None = None) -> list[JobHandle]:
        from hpcdist.jobs.registry import prepare, resolve
        from hpcdist.login import submit as sub
        from hpcdist.login.jobhandle import JobHandle
        from hpcdist.login.jobindex import find
        from hpcdist.login.plan import make
        from hpcdist.login.render import Origin

        if not callable(fn):
            raise ConfigError(f"hpcdist.Executor.submit: {fn!r} is a {type(fn).__name__}, not a function")
        module, qualname = _where(fn)
        data = {"name": _job_name(qualname), **self._data}  # the function's name, unless the spec named it
        folder = JobPaths(self.site.storage, data["name"]).calls
        from hpcdist.store.atomic import storage_umask

        with storage_umask(self.site.storage.umask):  # <logs>/<name> as storage.mode says, whatever the shell's umask
            paths = [_write_call(folder, fn, args, kwargs) for args, kwargs in calls]
        params = [{"call": str(p), "call_name": f"{module}:{qualname}",
                   "call_module": None if module == "__main__" else module} for p in paths]
        # One check and one code snapshot for all the calls (an array's items differ in their call only).
        base = prepare(self._check(data, params[0]), self.site)
        jobs = [base] if not array else [
            resolve(base.spec.model_copy(update={"name": item_name(base.spec.name, i, len(params)),
                                                 "params": {**base.spec.params, **p}}),
                    self.site, origin=ORIGIN, check=False) for i, p in enumerate(params)]
        origin = Origin(ORIGIN, self.site.name, tuple(f"site.{s}" for s in self._site_sets))
        if array and self.site.scheduler == "slurm" and len(jobs) > 1:
            origin = replace(origin, tasks=len(jobs), max_parallel=max_parallel)
            subs = sub.schedule(make(base.spec, self.site, origin, [j.spec for j in jobs]))
        else:  # the local site: a job per item, each waiting for the one `max_parallel` before it to end
            subs = []
            for i, j in enumerate(jobs):
                slot = subs[i - max_parallel] if max_parallel and i >= max_parallel else None
                with local_after(slot.record if slot is not None else None):
                    subs.append(sub.submit(j.spec, self.site, origin))
        # Each job is queued: its handle holds its record even where the index could not keep it
        # (add() warned), so a job is never reported missing, and retried, once it is queued.
        return [JobHandle(s.record or find(s.job_id, self.site.name), s) for s in subs]


def _spec_data(base: Mapping[str, Any], keys: Mapping[str, Any], sets: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with the keyword arguments (resources, or the spec's top-level keys) and the
    `set` paths (``env.X``; ``site.…`` keys go to the site) applied."""
    import copy

    from hpcdist.config.spec import JobSpec, Resources

    data = copy.deepcopy(dict(base))
    resources = set(Resources.model_fields)
    top = set(JobSpec.model_fields) - {"kind", "params", "resources"}
    for key, value in keys.items():
        if key in resources:
            data.setdefault("resources", {})[key] = value
        elif key in top:
            data[key] = value
        else:
            raise ConfigError(
                f"hpcdist.Executor: unknown argument {key}={value!r}; give a resource "
                f"({', '.join(sorted(resources))}), a job spec key ({', '.join(sorted(top))}), "
                f"or a deeper key as set={{'{key}.…': value}}"
            )
    from hpcdist.config import set_key

    for key, value in sets.items():
        if not key.startswith("site."):
            set_key(data, key, value, partial(_not_a_mapping, key))
    return data


def _yaml(value: Any) -> str:
    """A value as the YAML scalar `--set` reads (site keys go through the site loader's overrides)."""
    import json

    return value if isinstance(value, str) else json.dumps(value)


def _base(spec: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """The base spec: a YAML file's keys, a mapping, or nothing."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        return dict(spec)
    from hpcdist.config import read_yaml

    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"hpcdist.Executor: spec={str(spec)!r} does not exist; give a job spec YAML or a dict")
    data = read_yaml(path)
    if data.get("kind", "python") != "python":
        raise ConfigError(f"hpcdist.Executor: spec={str(spec)!r} is of kind {data['kind']!r}; the executor runs "
                          f"functions (kind python): leave kind and params out")
    data.pop("kind", None)
    return data


def _not_a_mapping(key: str, part: str) -> str:
    return f"hpcdist.Executor: set={{{key!r}: ...}}: {part!r} is not a mapping"


def _where(fn: Callable[..., Any]) -> tuple[str, str]:
    """The function's module and qualified name; a nested function (its qualname has
    ``<locals>``) or a lambda travels by value like one from ``__main__``."""
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
    if "<locals>" in qualname or qualname == "<lambda>":
        import cloudpickle

        if module != "__main__":
            cloudpickle.register_pickle_by_value(__import__(module, fromlist=["_"]))
        return "__main__", qualname
    return module, qualname


def item_name(base: str, index: int, count: int) -> str:
    """An array item's job name, hence its own checkpoint directory, results and progress (as a
    sweep's task has): ``<base>-<index>``, within a name's 128 characters."""
    suffix = f"-{index:0{len(str(count - 1))}d}"
    return base[:128 - len(suffix)] + suffix


@contextmanager
def local_after(record: JobRecord | None) -> Iterator[None]:
    """A local job submitted inside waits, before its ranks start, for the job of `record` to end."""
    from hpcdist.config.contract import LOCAL_AFTER_VAR

    if record is None:
        yield
        return
    os.environ[LOCAL_AFTER_VAR] = f"{record.job_id}:{record.started or ''}"
    try:
        yield
    finally:
        os.environ.pop(LOCAL_AFTER_VAR, None)


def _job_name(qualname: str) -> str:
    import re

    name = re.sub(r"[^A-Za-z0-9._-]", "_", qualname.replace("<locals>.", ""))[:100].lstrip("._-")
    return name or "function"


def _write_call(folder: Path, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Path:
    """The call pickled into `folder` (private to the user: arguments may be anything)."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise ConfigError(f"hpcdist.Executor.submit: the call of {getattr(fn, '__qualname__', fn)!r} cannot be "
                          f"pickled ({type(exc).__name__}: {exc}); pass plain data, or open files and "
                          f"connections inside the function") from exc
    from hpcdist.store.trust import private_folder

    private_folder(folder)  # 0700 whatever the umask: no one else replaces a call that every rank unpickles
    path = folder / f"{uuid.uuid4().hex}.pkl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    return path

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
hpcdist's bootstrap and ``hpcdist.init()``; see ``hpcdist.kinds.python_run``.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.contract import CALL_JOB_VAR
from hpcdist.config.paths import JobPaths
from hpcdist.errors import ConfigError, SubmitError
from hpcdist.kinds.python import wants_context
from hpcdist.login.submitit_params import site_for, translate, yaml_value
from hpcdist.scheduler import ssh

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec
    from hpcdist.kinds.registry import Job
    from hpcdist.login.jobhandle import JobHandle
    from hpcdist.login.jobindex import JobRecord
    from hpcdist.login.submit import Call

ORIGIN = "hpcdist.Executor"
class Executor:
    """Submits functions to a site as jobs of every rank; see the module's docstring.

    submitit's shape: ``Executor(folder)`` (submitit's first argument: where the job's pickles
    and logs go, ``%j`` the job id; default the site's ``storage.logs``), ``update_parameters``,
    ``submit``, ``map_array``, ``submit_array``, ``batch()``, submitit's parameter names
    (``timeout_min``, ``slurm_partition``, ``local_setup``, ...) beside hpcdist's. ``login="HOST"``
    (or ``$HPCDIST_LOGIN``): from a laptop through that login node, as ``hpcdist --on HOST``."""

    def __init__(self, folder: str | Path | None = None, *, site: str | None = None, cluster: str | None = None,
                 max_num_timeout: int | None = None, spec: str | Path | Mapping[str, Any] | None = None,
                 set: Mapping[str, Any] | None = None, login: str | None = None,  # noqa: A002 (submitit's name)
                 **keys: Any) -> None:
        from hpcdist.config import load_site

        if login is not None:  # as `hpcdist --on HOST`: Slurm's commands and the job's files over ssh, from now on
            ssh.use(login)
        if isinstance(folder, str) and "/" not in folder and "%" not in folder and not Path(folder).exists():
            from hpcdist.config import site_names

            if folder in site_names():
                raise ConfigError(f"hpcdist.Executor({folder!r}): the first argument is the folder for the job's "
                                  f"files (submitit's); for the site write hpcdist.Executor(site={folder!r})")
        self.folder = None if folder is None else Path(folder).expanduser().absolute()
        self._site_ref = site_for(site, cluster)
        self._site_sets = [f"{k.removeprefix('site.')}={yaml_value(v)}" for k, v in (set or {}).items()
                           if k.startswith("site.")]
        if max_num_timeout is not None:
            self._site_sets.append(f"preemption.max_requeues={int(max_num_timeout)}")
        self.site: Site = load_site(self._site_ref, self._site_sets)
        self._batch: list[tuple[JobHandle, Callable[..., Any], tuple[Any, ...], dict[str, Any]]] | None = None
        self._array_parallelism: int | None = None
        base = _base(spec)
        if self.folder is not None:
            base.setdefault("folder", str(self.folder))
        self._data: dict[str, Any] = {}
        self._apply(base, keys, set or {})

    @property
    def cluster(self) -> str:
        """submitit's name for where jobs run: ``slurm`` or ``local``."""
        return "slurm" if self.site.scheduler == "slurm" else "local"

    def update_parameters(self, **keys: Any) -> None:
        """Change resources or spec keys for later submissions (submitit's name); checked now."""
        if self._batch is not None:
            raise RuntimeError('Changing parameters within batch context "with executor.batch():" is not allowed')
        self._apply(self._data, keys, {})

    def _apply(self, base: Mapping[str, Any], keys: Mapping[str, Any], sets: Mapping[str, Any]) -> None:
        """`keys` (submitit's names or hpcdist's) onto the spec, or the site; checked at once."""
        from hpcdist.config import load_site

        spec_keys, site_sets, parallelism = translate(keys, self.site, self._data)
        self._array_parallelism = parallelism if parallelism is not None else self._array_parallelism
        data = _spec_data(base, spec_keys, sets)
        site = load_site(self._site_ref, self._site_sets + site_sets) if site_sets else self.site
        self._world_size = self._check(data, site=site).spec.resources.world_size
        self._data, self.site, self._site_sets = data, site, self._site_sets + site_sets

    def _check(self, data: Mapping[str, Any], params: Mapping[str, Any] | None = None,
               site: Site | None = None) -> Job[Any]:
        """The job as a YAML spec of it would be resolved: one ConfigError for the first problem."""
        from hpcdist.config import validate
        from hpcdist.config.spec import JobSpec
        from hpcdist.kinds.registry import resolve

        full = {"name": "function", **data, "kind": "python",
                "params": {**data.get("params", {}), **(params or {"call": "-", "snapshot": False})}}
        return resolve(validate(JobSpec, full, ORIGIN), site or self.site, origin=ORIGIN)

    @contextmanager
    def batch(self, allow_implicit_submissions: bool = False) -> Iterator[None]:
        """submitit's batch: the submissions inside are held and go in together when it ends,
        as one job array on Slurm; each handle is usable once the block is left."""
        if self._batch is not None:
            raise RuntimeError('Nesting "with executor.batch()" contexts is not allowed.')
        self._batch = []
        try:
            yield
        except BaseException:
            self._batch = None
            raise
        held, self._batch = self._batch, None
        if not held:
            import warnings

            warnings.warn('No submission happened during "with executor.batch()" context.', category=RuntimeWarning,
                          stacklevel=3)
            return
        real = self._submit_calls([(fn, a, kw) for _, fn, a, kw in held], True, self._array_parallelism)
        for (handle, *_), job in zip(held, real, strict=True):
            handle.__dict__.update(job.__dict__)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> JobHandle:
        """Run ``fn(*args, **kwargs)`` on every rank of one job; its handle, at once."""
        if self._batch is not None:
            from hpcdist.login.jobhandle import JobHandle

            held = JobHandle.__new__(JobHandle)
            self._batch.append((held, fn, args, kwargs))
            return held
        return self._submit_calls([(fn, args, kwargs)], array=False)[0]

    def submit_array(self, fns: Sequence[Callable[[], Any]]) -> list[JobHandle]:
        """One job array of the callables (each called without arguments; submitit's name)."""
        return self._submit_calls([(fn, (), {}) for fn in fns], array=True, max_parallel=self._array_parallelism)

    def map_array(self, fn: Callable[..., Any], *iterables: Iterable[Any], max_parallel: int | None = None,
                  first_index: int = 0) -> list[JobHandle]:
        """One job array, a job per item: ``fn(a, b, ...)`` for each tuple of the iterables'
        items (submitit's shape: a list of jobs, not of results). `max_parallel` tasks at a time.
        On the local site, with no scheduler, each item is a job of its own. Item i is named
        ``<name>-<first_index + i>`` (a later batch of one sweep continues its numbers)."""
        calls: list[Call] = [(fn, tuple(i), {}) for i in zip(*iterables, strict=True)]
        if max_parallel is not None and max_parallel < 1:
            raise ConfigError(f"hpcdist.Executor.map_array: max_parallel={max_parallel}; give at least 1, or None")
        return self._submit_calls(calls, True, max_parallel or self._array_parallelism, first_index)

    def _submit_calls(self, calls: list[Call], array: bool, max_parallel: int | None = None, first: int = 0
                      ) -> list[JobHandle]:
        if not calls:
            return []
        for fn, _, _ in calls:
            if not callable(fn):
                raise ConfigError(f"hpcdist.Executor.submit: {fn!r} is a {type(fn).__name__}, not a function")
        try:
            if self._world_size == 1 and not any(wants_context(fn) for fn, _, _ in calls):
                return self._submit_direct(calls, array, max_parallel, first)
            return self._submit_all(calls, array, max_parallel, first)
        except OSError as exc:  # a storage folder not this user's: one line saying whose, as `hpcdist submit`
            from hpcdist.files.roots import denied_hint

            name = getattr(calls[0][0], "__qualname__", repr(calls[0][0]))
            raise SubmitError(f"could not submit {name} to site {self.site.name}: {exc}{denied_hint(exc)}") from exc
    def _submit_direct(self, calls: list[Call], array: bool, max_parallel: int | None, first: int) -> list[JobHandle]:
        """One task and no group asked for: submitit runs the function itself on the node, as its
        own executors do (no bootstrap, no torch, submitit's checkpoint-and-requeue). Its package
        is snapshot as for any call; ``hpcdist.init()`` inside still works (``HPCDIST_CALL_JOB``)."""
        from hpcdist.kinds.registry import prepare

        module, qualname = _where(calls[0][0])
        data = {"name": _job_name(qualname), **self._data}
        params = {"call": "submitit", "call_name": f"{module}:{qualname}", "direct": True,
                  "call_module": None if module == "__main__" else module}
        base = prepare(self._check(data, params), self.site)
        return self._schedule([base.spec] * len(calls), calls, array, max_parallel, first)

    def _submit_all(self, calls: list[Call], array: bool, max_parallel: int | None, first: int) -> list[JobHandle]:
        """Several tasks, or a function that takes the rank's Context: hpcdist's bootstrap and
        group on every rank, then the function (``hpcdist.kinds.python_run``)."""
        from hpcdist.kinds.registry import prepare

        module, qualname = _where(calls[0][0])
        data = {"name": _job_name(qualname), **self._data}
        folder = JobPaths(self.site.storage, data["name"]).calls
        from hpcdist.files import roots
        from hpcdist.files.atomic import storage_umask

        with storage_umask(self.site.storage.umask):  # <logs>/<name> as storage.mode says, whatever the shell's umask
            roots.ready(self.site.storage, self.site.name)  # the calls go nowhere but into her own <logs>/<user>
            pickles = [_write_call(folder, fn, args, kwargs) for fn, args, kwargs in calls]
        params = []
        for (fn, _, _), path in zip(calls, pickles, strict=True):
            mod, qual = _where(fn)
            params.append({"call": str(path), "call_name": f"{mod}:{qual}",
                           "call_module": None if mod == "__main__" else mod})
        # One check and one code snapshot for all the calls (an array's items differ in their call only).
        base = prepare(self._check(data, params[0]), self.site)
        specs = [base.spec.model_copy(update={"params": {**base.spec.params, **p}}) for p in params]
        return self._schedule(specs, None, array, max_parallel, first)

    def _schedule(self, specs: list[JobSpec], calls: list[Call] | None, array: bool, max_parallel: int | None,
                  first: int) -> list[JobHandle]:
        """The jobs queued: on Slurm one job array (or one job); on the local site a job per item,
        each waiting for the one `max_parallel` before it to end."""
        from hpcdist.kinds.registry import resolve
        from hpcdist.login import submit as sub
        from hpcdist.login.jobhandle import JobHandle
        from hpcdist.login.jobindex import find
        from hpcdist.login.plan import Origin, make

        if array:
            specs = [s.model_copy(update={"name": item_name(s.name, first + i, first + len(specs))})
                     for i, s in enumerate(specs)]
        if calls is not None:
            specs = self._direct_env(specs, shared=array and self.site.scheduler == "slurm" and len(specs) > 1)
        jobs = [resolve(s, self.site, origin=ORIGIN, check=False).spec for s in specs]
        origin = Origin(ORIGIN, self.site.name, tuple(f"site.{s}" for s in self._site_sets))
        if array and self.site.scheduler == "slurm" and len(jobs) > 1:
            origin = replace(origin, tasks=len(jobs), max_parallel=max_parallel)
            subs = sub.schedule(make(jobs[0], self.site, origin, jobs), calls)
        else:
            subs = []
            for i, j in enumerate(jobs):
                slot = subs[i - max_parallel] if max_parallel and i >= max_parallel else None
                with local_after(slot.record if slot is not None else None):
                    subs += sub.schedule(make(j, self.site, origin), None if calls is None else calls[i:i + 1])
        if self.site.scheduler == "slurm":
            from hpcdist.login.watch import watch_together

            watch_together([s.job_id for s in subs])
        # Each job is queued: its handle holds its record even where the index could not keep it
        # (add() warned), so a job is never reported missing, and retried, once it is queued.
        return [JobHandle(s.record or find(s.job_id, self.site.name), s) for s in subs]

    def _direct_env(self, specs: list[JobSpec], shared: bool) -> list[JobSpec]:
        """Direct calls' specs with what each task reads: its spec and site in a 0600 file
        (``hpcdist.init()`` inside), and its code snapshot (first on ``sys.path``). A Slurm
        array's tasks share one script: its variable names the files with ``%a``, which the task
        reads as its ``SLURM_ARRAY_TASK_ID``."""
        from hpcdist.files.atomic import storage_umask

        folder, stem = JobPaths(self.site.storage, specs[0].name).calls, uuid.uuid4().hex
        with storage_umask(self.site.storage.umask):
            site = self.site.model_dump(mode="json")
            files = [_write_private(folder, f"{stem}-{i}.json", json.dumps(
                {"spec": s.model_dump(mode="json"), "site": site}).encode()) for i, s in enumerate(specs)]
        out = []
        for spec, path in zip(specs, files, strict=True):
            env = {**spec.env, CALL_JOB_VAR: str(folder / f"{stem}-%a.json") if shared else str(path)}
            code_dir = spec.params.get("code_dir")
            if code_dir:
                env[CODE_DIR_VAR] = code_dir
            out.append(spec.model_copy(update={"env": env}))
        return out


class AutoExecutor(Executor):
    """submitit's ``AutoExecutor(folder, cluster=None|"local"|"slurm")``: `cluster` picks the
    site's kind (None: ``$HPCDIST_SITE`` or the default site; "local": the local site; "slurm":
    ``site=`` or ``$HPCDIST_SITE``, which must be a Slurm site)."""

    def __init__(self, folder: str | Path | None = None, cluster: str | None = None, **kwargs: Any) -> None:
        super().__init__(folder, cluster=cluster, **kwargs)


CODE_DIR_VAR = "HPCDIST_CODE_DIR"  # a direct call's code snapshot, first on the rank's sys.path


def _write_private(folder: Path, name: str, payload: bytes) -> Path:
    """`payload` in the new file `name` of `folder`, the user's own (0700 folder, 0600 file)."""
    from hpcdist.files.trust import private_folder

    private_folder(folder)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    return path


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
            raise ConfigError(f"hpcdist.Executor: unknown argument {key}={value!r}; give a resource "
                              f"({', '.join(sorted(resources))}), a job spec key ({', '.join(sorted(top))}), "
                              f"or a deeper key as set={{'{key}.…': value}}")
    from hpcdist.config import set_key

    for key, value in sets.items():
        if not key.startswith("site."):
            set_key(data, key, value, partial(_not_a_mapping, key))
    return data


def _not_a_mapping(key: str, part: str) -> str:
    return f"hpcdist.Executor: set={{{key!r}: ...}}: {part!r} is not a mapping"


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


def _where(fn: Callable[..., Any]) -> tuple[str, str]:
    """The function's module and qualified name. A nested function or a lambda travels by value
    (cloudpickle does so for what cannot be found by name), with the globals it names by
    reference to its module, which the nodes import from the snapshot, as submitit ships it."""
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
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
    """The call pickled into `folder` (private to the user: arguments may be anything; 0700
    whatever the umask: no one else replaces a call that every rank unpickles)."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise ConfigError(f"hpcdist.Executor.submit: the call of {getattr(fn, '__qualname__', fn)!r} cannot be "
                          f"pickled ({type(exc).__name__}: {exc}); pass plain data, or open files and "
                          f"connections inside the function") from exc
    return _write_private(folder, f"{uuid.uuid4().hex}.pkl", payload)

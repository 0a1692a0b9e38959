"""Loading site configs and job specs (both sides: the login side plans with them, every rank
reads them back): YAML (safe_load only), overrides, and clear errors.

Every problem becomes one ``ConfigError`` naming the file, the key path, the value seen, and
what is allowed, so a user fixes the file without reading a traceback.
"""

from __future__ import annotations

import functools
import os
import typing
from pathlib import Path
from typing import Any

from hpcdist._paths import data_dir
from hpcdist.errors import ConfigError

if typing.TYPE_CHECKING:  # PyYAML, pydantic and the models load on first use: a rank's task runner and the
    from pydantic import BaseModel  # local controller import ``hpcdist.config.contract`` without them

    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec

__all__ = [
    "Site", "JobSpec", "load_site", "load_spec", "read_spec", "check_fits", "find_site", "apply_overrides",
    "site_names", "site_name", "is_site_path", "validate",
]

DEFAULT_SITE = "local"


def site_search_path() -> list[Path]:
    """Where `--site NAME` looks: $HPCDIST_SITE_PATH, ./site_configs (only from a folder no one
    else can write: `_named_site_file`), the user's own (``hpcdist site init`` writes there:
    ``~/.config/hpcdist/sites``), then the shipped sites."""
    from hpcdist.config.discovered import user_sites_dir

    dirs = [Path(p) for p in os.environ.get("HPCDIST_SITE_PATH", "").split(os.pathsep) if p]
    return [*dirs, Path.cwd() / "site_configs", user_sites_dir(), data_dir("site_configs")]


def site_names() -> list[str]:
    from hpcdist.config.discovered import SLURM, auto_site

    names = {p.stem for d in site_search_path() if d.is_dir() for p in d.glob("*.yaml")}
    return sorted(names | ({SLURM} if auto_site() == SLURM else set()))


def is_site_path(ref: str) -> bool:
    """Whether `--site REF` is a path to a site YAML (`my-site.yaml`, `conf/site`) rather than a
    site's name: the one rule every command that takes `--site` follows."""
    return ref.endswith((".yaml", ".yml")) or os.sep in ref


def _named_site_file(name: str) -> Path | None:
    """The first `<name>.yaml` on the site search path, or None. One in ``./site_configs`` is read
    only where no one else could have written it (``hpcdist.files.trust``: yours or root's, no
    group or world write, in folders of yours or root's): its ``setup:`` lines run as you. Another
    is one ConfigError naming it, its owner and mode; one that shadows a shipped site is said once."""
    found = next((p for p in (d / f"{name}.yaml" for d in site_search_path()) if p.is_file()), None)
    if found is not None and found.parent == Path.cwd() / "site_configs":
        _check_here(found, name)
    return found


def _check_here(path: Path, name: str) -> None:
    shipped = data_dir("site_configs") / f"{name}.yaml"
    if shipped.is_file() and shipped.resolve() == path.resolve():
        return  # hpcdist's own folder (a run from its source tree)
    from hpcdist.files import trust

    why = trust.problem(path)
    if why is not None:
        raise ConfigError(
            f"site {name!r}: refusing {trust.describe(path, path.lstat())} in the current folder: {why}; its "
            f"setup: lines would run as you; run from a folder of your own, or pass a file you trust as --site "
            f"PATH (or its folder in HPCDIST_SITE_PATH)"
        )
    if shipped.is_file():
        _say_shadowed(path, name, shipped)


@functools.cache
def _say_shadowed(path: Path, name: str, shipped: Path) -> None:
    import sys

    print(f"hpcdist: note: site {name!r} is {path}, which shadows the shipped one ({shipped})", file=sys.stderr)


def find_site(name_or_path: str | None) -> Path:
    """The file for a site name (`local-slurm`) or path (`my/site.yaml`); ``slurm``: the cluster
    srun talks to, as discovered (``hpcdist.config.discovered``). None (and no $HPCDIST_SITE):
    ``slurm`` where srun is on PATH, else ``local``, said once on stderr."""
    from hpcdist.config import discovered

    name = name_or_path or os.environ.get("HPCDIST_SITE") or _auto_site()
    if name == discovered.SLURM and _named_site_file(name) is None:
        return discovered.discovered_site()
    if is_site_path(name):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"site config {name!r} does not exist; pass a site name or a YAML file")
        return path
    found = _named_site_file(name)
    if found is not None:
        return found
    raise ConfigError(
        f"unknown site {name!r}; known sites: {', '.join(site_names())} "
        f"(or pass a path to a site YAML, or add a directory to HPCDIST_SITE_PATH)"
    )


@functools.cache
def _auto_site() -> str:
    import sys

    from hpcdist.config.discovered import SLURM, auto_site
    from hpcdist.scheduler.ssh import login

    chosen = SLURM if login() else auto_site()  # `--on HOST`: the cluster behind that login node
    if chosen == SLURM and not login():
        print("hpcdist: no site named: Slurm's srun is on PATH, so jobs go to that cluster, read from it "
              "(`hpcdist sites --show slurm`); --site local runs them on this machine", file=sys.stderr)
    return chosen


def __getattr__(name: str) -> Any:
    if name in ("Site", "JobSpec"):
        import importlib

        return getattr(importlib.import_module(f"hpcdist.config.{'site' if name == 'Site' else 'spec'}"), name)
    raise AttributeError(f"module 'hpcdist.config' has no attribute {name!r}")


def safe_load(text: str) -> Any:
    """`yaml.safe_load`, through libyaml's parser when PyYAML has it (several times faster; the
    same safe constructor makes the values). A text it refuses is read again by the pure-Python
    loader, whose error names the offending character and the line where the problem is."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", None)
    if loader is not None:
        try:
            return yaml.load(text, Loader=loader)
        except yaml.YAMLError:
            pass
    return yaml.safe_load(text)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from `path`, read with safe_load: tags such as !!python/object are refused."""
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"{path}:{where}: not valid YAML ({problem}); only plain YAML is accepted "
            f"(no !!python tags)"
        ) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str], origin: str) -> dict[str, Any]:
    """`key.path=value` strings applied to a nested mapping; values are parsed as YAML scalars."""
    import yaml

    out = _deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. resources.nodes=2")
        try:
            value = safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: value is not valid YAML") from exc
        set_key(out, key, value, functools.partial("--set {!r}: {} key {!r} is not a mapping".format, item, origin))
    return out


def set_key(data: dict[str, Any], key: str, value: Any, not_a_mapping: typing.Callable[[str], str]) -> None:
    """``data[a][b] = value`` for the key path ``a.b``, making the mappings on the way; a step
    that holds something else is one ConfigError, worded by `not_a_mapping(step)`."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(not_a_mapping(part))
        node = nxt
    node[parts[-1]] = value


def load_site(name_or_path: str | None = None, overrides: list[str] | None = None) -> Site:
    from hpcdist.config.discovered import is_cached
    from hpcdist.config.site import Site, pin_launcher_args

    path = find_site(name_or_path)
    cached = is_cached(path)
    try:
        data = pin_launcher_args(read_yaml(path))
        if cached and overrides:  # the reading itself first: an override's mistake is the user's
            validate(Site, {**data, "name": path.stem}, path)
        elif not overrides:
            return validate(Site, {**data, "name": path.stem}, path)
    except ConfigError as exc:
        if not cached:
            raise
        # hpcdist's own reading of the cluster, not a file of the user's: say so, and read it again next time
        path.unlink(missing_ok=True)
        raise ConfigError(f"hpcdist could not express the Slurm cluster {path.stem!r} as a site (its own reading, "
                          f"not a file of yours; it is read again at the next command): "
                          f"{str(exc).removeprefix(f'{path}: ')}; `hpcdist site init NAME` writes the reading as a "
                          f"file to correct and use as --site NAME") from None
    data = apply_overrides(data, overrides or [], "site")
    # a site is named as it was named, by its file (`--site mine.yaml` is site `mine`, whatever its
    # name: says), so a copied site file never files its jobs under the site it was copied from
    return validate(Site, {**data, "name": path.stem}, path)


def site_name(ref: str) -> str:
    """The name the site `--site REF` means is recorded under (``Site.name``: what `submit`
    writes in the job index and `hpcdist jobs` shows), so a follow-up command given the same
    `--site` as the submit finds its jobs. A site is named by its file (``load_site``): a path's
    stem (a missing file is the same one-line ConfigError as at submit), a name as it is, and
    ``slurm`` the discovered cluster's name."""
    if is_site_path(ref) or ref == "slurm":
        return find_site(ref).stem
    return ref


Rebase = typing.Callable[[dict[str, Any], Path], dict[str, Any]]


def read_spec(path: str | Path, overrides: list[str] | None = None, rebase: Rebase | None = None) -> JobSpec:
    """A job spec file as a JobSpec, validated on its own; its params stay a dict for the job
    registry (``hpcdist.kinds.registry.resolve``) to parse with the kind's model. `rebase(data,
    folder)` makes the relative paths in `data` absolute: the file's against its folder, then
    those the overrides set against the current folder."""
    from hpcdist.config.spec import JobSpec

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job spec {str(path)!r} does not exist")
    data = read_yaml(path)
    if rebase is not None:
        data = rebase(data, path.resolve().parent)
    data = apply_overrides(data, overrides or [], "job")
    if rebase is not None and overrides:
        data = rebase(data, Path.cwd())
    return validate(JobSpec, data, path)


def check_fits(spec: JobSpec, site: Site, origin: Path | str) -> None:
    """One ConfigError for the first thing that makes `spec` impossible on `site`."""
    from hpcdist.config.spec import fit_to_site

    for key, value, allowed in fit_to_site(spec, site):
        raise ConfigError(f"{origin}: {key}: {value!r} is not possible on site {site.name!r}; allowed: {allowed}")


def load_spec(path: str | Path, site: Site, overrides: list[str] | None = None) -> JobSpec:
    """A job spec read and fitted to `site`; its params are parsed by ``hpcdist.kinds.registry.load_job``."""
    spec = read_spec(path, overrides)
    check_fits(spec, site, Path(path))
    return spec


M = typing.TypeVar("M", bound="BaseModel")


def validate(model: type[M], data: object, path: Path | str, prefix: tuple[str, ...] = ()) -> M:
    """`data` as a `model`, or one ConfigError naming the file and each bad key path."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(model, err, prefix) for err in exc.errors()]
        raise ConfigError(f"{path}: " + "; ".join(lines)) from None


def _describe(model: type[BaseModel], err: Any, prefix: tuple[str, ...]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(prefix + loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(model, loc[:-1])
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        return f"{key}: unknown key{hint}"
    if err["type"] == "missing":
        return f"{key}: required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a check of the whole file names its values itself; the file as a dict would be a page
        return f"{key}: {msg}"
    return f"{key}: {msg} (got {_shown(err.get('input'))!r})"


def _shown(value: object) -> object:
    """A value for an error message: a mapping's secret-looking entries without their values."""
    from hpcdist.config.site import REDACTED, looks_secret

    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and looks_secret(k) else _shown(v) for k, v in value.items()}
    return value


def _fields_at(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    """Field names of the model reached by walking `loc` from `model` (dict keys are names)."""
    from pydantic import BaseModel

    current: Any = model
    for part in loc:
        if typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(part)
        if field is None:
            return []
        current = field.annotation
        if typing.get_origin(current) is not dict:
            models = [a for a in typing.get_args(current) if isinstance(a, type) and issubclass(a, BaseModel)]
            current = models[0] if models else current
    if isinstance(current, type) and issubclass(current, BaseModel):
        return sorted(current.model_fields)
    return []


def _deepcopy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in data.items()}

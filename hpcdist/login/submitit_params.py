"""submitit's executor parameters as hpcdist's job spec and site keys, for ``hpcdist.Executor``.

submitit's ``AutoExecutor`` takes generic parameters bare (``timeout_min``, ``mem_gb``, ``nodes``,
``tasks_per_node``, ``cpus_per_task``, ``gpus_per_node``, ``name``, ``stderr_to_stdout``) and the
others with the cluster's prefix (``slurm_partition``, ``slurm_additional_parameters``,
``local_setup``); each is mapped here onto the job spec (``time_min``, ``partition``, ``sbatch``)
or the site (``setup``, ``python``, ``preemption.seconds_before_end``), once: the names of Slurm's
parameters come from their one table (``hpcdist.config.sbatch.PARAMETERS``), the others are
here. Another cluster's prefix is ignored, as submitit ignores it; what has no meaning in hpcdist
is one ``ConfigError`` with its reason. Any other ``slurm_X`` becomes the ``#SBATCH --X`` line, as submitit makes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpcdist.config.sbatch import submitit_names
from hpcdist.errors import ConfigError

if TYPE_CHECKING:
    from hpcdist.config.site import Site

# submitit's parameter names, as hpcdist's job spec (or site) spells them (submitit's AutoExecutor
# takes the generic ones bare and the others with the cluster's prefix: slurm_partition, local_setup):
# Slurm's from their table, and two that are no one parameter of it
RENAMED = {**submitit_names(), "gpus_per_task": None, "additional_parameters": "sbatch"}
SITE_KEYS = {"signal_delay_s": "preemption.seconds_before_end", "python": "python", "setup": "setup"}
MEANINGLESS = {
    "use_srun": "hpcdist always starts the ranks with the site's launcher (launcher.kind)",
    "srun_args": "the site's launcher line holds srun's arguments: set={'site.launcher.args': [...]}",
    "visible_gpus": "the local site has no GPU selection of its own",
    "array_parallelism": None,  # map_array's max_parallel (kept, not a spec key)
    "max_pickle_size_gb": None,  # submitit's own check, kept by submitit
    "wckey": "hpcdist passes Slurm options through slurm_additional_parameters",
}


def translate(keys: Mapping[str, Any], site: Site, data: Mapping[str, Any]
              ) -> tuple[dict[str, Any], list[str], int | None]:
    """submitit's parameters as job spec keys and site overrides; what has no meaning here is
    one ConfigError with its reason. A prefix of the other scheduler is ignored, as submitit's
    AutoExecutor ignores another cluster's parameters."""
    own, other = (("slurm_", "local_") if site.scheduler == "slurm" else ("local_", "slurm_"))
    spec: dict[str, Any] = {}
    sets: list[str] = []
    parallelism: int | None = None
    for key, value in keys.items():
        if key.startswith(other):
            continue
        name = key.removeprefix(own)
        if name == "array_parallelism":
            parallelism = int(value)
            continue
        if name in SITE_KEYS:
            target = SITE_KEYS[name]
            if target == "setup":
                value = [*site.setup, *value] if not isinstance(value, str) else [*site.setup, value]
            sets.append(f"{target}={yaml_value(value)}")
            continue
        if name in MEANINGLESS:
            why = MEANINGLESS[name]
            if why is None:
                continue
            raise ConfigError(f"hpcdist.Executor: {key}={value!r} has no meaning here: {why}")
        if name in RENAMED and name not in _spec_names():
            renamed = RENAMED[name]
            if renamed is None:
                raise ConfigError(f"hpcdist.Executor: {key}={value!r}: hpcdist gives each rank its GPUs by the "
                                  f"site's binding (docs/gpus.md); ask gpus_per_node instead")
            if renamed == "sbatch":
                value = {**data.get("sbatch", {}), **dict(value)}
            name = renamed
        elif own == "slurm_" and key.startswith(own) and name not in _spec_names():  # another Slurm option: #SBATCH
            options = spec.setdefault("sbatch", dict(data.get("sbatch", {})))
            options[name.replace("_", "-")] = value
            continue
        spec[name] = value
    return spec, sets, parallelism


def slurm_keys(keys: Mapping[str, Any]) -> dict[str, Any]:
    """submitit's SlurmExecutor's parameters (bare Slurm names: ``partition``, ``time``,
    ``ntasks_per_node``, ``mem``) as its AutoExecutor spells them (``slurm_partition``, ...),
    which ``translate`` reads; Slurm's ``mem`` ("16GB", "500M", a bare number in MB) is ``mem_gb``."""
    out: dict[str, Any] = {}
    for key, value in keys.items():
        name = key.removeprefix("slurm_")
        if MEANINGLESS.get(name) or (name in RENAMED and RENAMED[name] is None):  # said by the name the user gave
            why = MEANINGLESS.get(name) or "hpcdist gives each rank its GPUs by the site's binding (docs/gpus.md)"
            raise ConfigError(f"hpcdist.SlurmExecutor: {key}={value!r} has no meaning here: {why}")
        if key == "mem":
            out["mem_gb"] = mem_gb(value)
        else:
            out[key if key.startswith("slurm_") else f"slurm_{key}"] = value
    return out


def mem_gb(value: Any) -> float:
    """Slurm's ``--mem`` value in GB: a number with K, M, G or T (B allowed after it), MB when bare."""
    import re

    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(value), re.IGNORECASE)
    if found is None:
        raise ConfigError(f"hpcdist.SlurmExecutor: mem={value!r} is not a size Slurm reads; give e.g. "
                          f"mem='16GB', mem='500M', or mem_gb=16")
    scale = {"K": 1 / 1024**2, "M": 1 / 1024, "": 1 / 1024, "G": 1.0, "T": 1024.0}[found[2].upper()]
    return float(found[1]) * scale


def site_for(site: str | None, cluster: str | None) -> str | None:
    """The site an executor runs on, from hpcdist's `site` and submitit's `cluster`: None names
    none (``$HPCDIST_SITE``, else Slurm where srun is on PATH, else local: submitit's rule);
    "slurm" with no Slurm site named is the cluster srun talks to, as discovered."""
    if cluster is None or cluster == "local" and site is None:
        return "local" if cluster == "local" else site
    if cluster not in ("local", "slurm", "debug"):
        raise ConfigError(f"hpcdist.Executor: cluster={cluster!r}; give 'local', 'slurm' or None "
                          f"(the site names the cluster: site='NAME')")
    if cluster == "debug":
        raise ConfigError("hpcdist.Executor: cluster='debug' (submitit's in-process executor) has no hpcdist "
                          "equivalent; use cluster='local' (processes on this machine)")
    from hpcdist.config import load_site

    ref = site or os.environ.get("HPCDIST_SITE")
    if ref is None and cluster == "slurm":
        return "slurm"
    chosen = load_site(ref)
    if (chosen.scheduler == "slurm") != (cluster == "slurm"):
        raise ConfigError(f"hpcdist.Executor: cluster={cluster!r} but site {chosen.name!r} is a "
                          f"{chosen.scheduler} site; name a {cluster} site with site='NAME' (or $HPCDIST_SITE)")
    return ref


def _spec_names() -> set[str]:
    from hpcdist.config.spec import JobSpec, Resources

    return set(Resources.model_fields) | set(JobSpec.model_fields)


def yaml_value(value: Any) -> str:
    """A value as the YAML scalar a ``--set``-style override reads (site keys go through the
    site loader's overrides)."""
    return value if isinstance(value, str) else json.dumps(value)

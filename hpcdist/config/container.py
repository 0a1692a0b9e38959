"""Containers in the site config and the job spec (both sides), and the plan a launch line wraps
its ranks with (``hpcdist.containers``).

A site says which runtimes it has (``containers: {charliecloud: {args: [...], mounts: [...]}}``)
and may give every job a default ``container:``; a job's own ``container:`` section wins key by
key (``--set container.image=...`` on a site with a default runtime is enough), and
``runtime: none`` runs it outside. What each rank must see inside is bound at the same path:
the site's storage roots (results, checkpoints, scratch and logs: submitit's pickles and the
code snapshot are there), the site's mounts for the runtime (PMIx's server folder, Slurm's
``TmpFS``), then the job's. ``problems`` checks a job against its site without I/O; ``placed``
(the login side, at submit) checks the image and the mounts on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, Field

from hpcdist.config.base import Frozen
from hpcdist.containers import Bind, ContainerPlan, get_runtime, runtime_names

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec

NONE = "none"  # `runtime: none`: this job runs outside the site's default container


def _mount(value: str) -> str:
    source, _, target = value.partition(":")
    for part in (source, target or source):
        if not part.startswith("/") or "," in part or ":" in part:
            raise ValueError(
                f"{value!r} is not a mount: write an absolute host folder, or SRC:DST with both absolute "
                f"(no ',' or more ':'), e.g. /shared/datasets or /shared/datasets:/data"
            )
    return value


Mount = Annotated[str, AfterValidator(_mount)]


def _runtime(value: str | None) -> str | None:
    if value is not None and value != NONE and value not in runtime_names():
        raise ValueError(f"unknown container runtime; hpcdist knows {', '.join(runtime_names())} (or none)")
    return value


class RuntimeSite(Frozen):
    """One runtime as the site has it: extra arguments for it, and what every container of it binds."""

    args: tuple[str, ...] = Field(default=(), description="extra arguments, e.g. [--set-env=/etc/ch.env]")
    mounts: tuple[Mount, ...] = Field(default=(), description="bound in every job's container (PMIx's folder)")


class Container(Frozen):
    """A job's container: the runtime, the image, the image's Python and extra mounts."""

    runtime: Annotated[str | None, AfterValidator(_runtime)] = Field(
        default=None, description=f"{' | '.join(runtime_names())} | none")
    image: str | None = Field(default=None, min_length=1, description="a path, or what the runtime takes "
                              "(pyxis: nvcr.io#nvidia/pytorch:24.10-py3)")
    mounts: tuple[Mount, ...] = Field(default=(), description="host folders bound inside, beside hpcdist's own")
    python: str | None = Field(default=None, min_length=1, description="the image's Python (default python3)")


def sites_runtimes(value: dict[str, RuntimeSite]) -> dict[str, RuntimeSite]:
    """The keys of a site's ``containers:``: registered runtimes."""
    unknown = sorted(set(value) - set(runtime_names()))
    if unknown:
        raise ValueError(f"unknown container runtime(s) {', '.join(unknown)}; hpcdist knows "
                         f"{', '.join(runtime_names())}")
    return value


def container_for(spec: JobSpec, site: Site) -> Container | None:
    """The job's container: the site's default with the job's own keys over it; None to run outside."""
    base = site.container.model_dump(exclude_unset=True) if site.container else {}
    own = spec.container.model_dump(exclude_unset=True) if spec.container else {}
    merged = Container(**{**base, **own})
    if merged.runtime == NONE or (merged.runtime is None and merged.image is None):
        return None
    return merged


def problems(spec: JobSpec, site: Site) -> list[tuple[str, object, str]]:
    """What makes the job's container impossible on `site` (key path, value, what is allowed); no I/O."""
    box = container_for(spec, site)
    if box is None:
        return []
    if box.runtime is None:
        have = sorted(site.containers) or "(none: the site has no runtime)"
        return [("container.runtime", box.runtime, f"one of {have} for image {box.image!r}")]
    if site.scheduler != "slurm":
        return [("container", box.runtime, f"a Slurm site: site {site.name!r} starts its ranks in this Python; "
                 f"drop the container or use a Slurm site")]
    if box.runtime not in site.containers:
        have = ", ".join(sorted(site.containers)) or "none"
        return [("container.runtime", box.runtime, f"one of the site's runtimes: {have} (its config lists them "
                 f"under containers:)")]
    if box.image is None:
        return [("container.image", None, "the image to run, e.g. --set container.image=/shared/images/pytorch")]
    if get_runtime(box.runtime).srun_only and site.launcher.kind not in ("srun", "torchrun"):
        return [("container.runtime", box.runtime, f"a launcher that starts its ranks with srun ({box.runtime} is an "
                 f"srun plugin), not launcher.kind {site.launcher.kind!r}")]
    return []


def plan_for(spec: JobSpec, site: Site) -> ContainerPlan | None:
    """The container a launch line wraps each rank in, binds as written (no I/O): the storage
    roots, the site's mounts for the runtime, the job's; a bind under another is dropped."""
    box = container_for(spec, site)
    if box is None or box.runtime in (None, NONE) or box.image is None or box.runtime not in site.containers:
        return None
    runtime = site.containers[box.runtime]
    roots = [str(getattr(site.storage, r)) for r in ("results", "checkpoints", "scratch", "logs")]
    binds = [Bind(r, r) for r in roots] + [Bind.parse(m) for m in (*runtime.mounts, *box.mounts)]
    return ContainerPlan(box.runtime, box.image, box.python or "python3", _outermost(binds), runtime.args,
                         gpus=spec.resources.gpus_per_node > 0)


def _outermost(binds: list[Bind]) -> tuple[Bind, ...]:
    """Each bind once; one whose source and target both lie under another's is already inside it."""
    out: list[Bind] = []
    for b in binds:
        covered = any(_under(b.source, o.source) and _under(b.target, o.target)
                      and os.path.relpath(b.source, o.source) == os.path.relpath(b.target, o.target)
                      for o in binds if o is not b and (o.source, o.target) != (b.source, b.target))
        if not covered and b not in out:
            out.append(b)
    return tuple(out)


def _under(path: str, parent: str) -> bool:
    return os.path.commonpath([path, parent]) == parent.rstrip("/") or parent == "/"


def fold_onto_image(plan: ContainerPlan) -> tuple[ContainerPlan, list[str]]:
    """Charliecloud's image folders (0.31 binds only onto a folder the image has): each bind of
    the same path inside moved up to the deepest folder of its path that the image has and that
    is empty there (a mount point made for it, which hides nothing of the image); returned with
    the targets no such folder serves. Other runtimes make their targets: unchanged."""
    root = Path(plan.image)
    if plan.runtime != "charliecloud" or not root.is_dir():
        return plan, []
    binds, missing = [], []
    for b in plan.binds:
        if (root / b.target.lstrip("/")).is_dir():
            binds.append(b)
            continue
        if b.source != b.target:
            missing.append(b.target)
            continue
        point = Path(b.target).parent
        while point != Path("/") and not (root / str(point).lstrip("/")).is_dir():
            point = point.parent
        inside = root / str(point).lstrip("/")
        if point == Path("/") or any(inside.iterdir()):
            missing.append(b.target)
        else:
            binds.append(Bind(str(point), str(point)))
    return ContainerPlan(plan.runtime, plan.image, plan.python, _outermost(binds), plan.args, plan.gpus), missing

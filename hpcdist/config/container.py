"""Containers in the site config and the job spec (both sides), and the plan a launch line wraps
its ranks with (``hpcdist.containers``).

A site says which runtimes it has (``containers: {charliecloud: {args: [...], mounts: [...]}}``)
and may give every job a default ``container:``; a job's own ``container:`` section wins key by
key (``--set container.image=...`` on a site with a default runtime is enough), and
``runtime: none`` runs it outside. What each rank must see inside is bound at the same path:
the site's storage roots (results, checkpoints, scratch and logs: submitit's pickles and the
code snapshot are there), the site's PMIx folder for the runtime (``pmix_dir``) and its mounts,
then the job's. ``config.spec`` merges a job's container with its site's and checks
it (no I/O); ``placed`` here checks the image and the mounts on disk at submit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from hpcdist.config.base import Frozen
from hpcdist.containers import Bind, ContainerPlan, get_runtime, runtime_names
from hpcdist.errors import SubmitError

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


def _folder(value: str | None) -> str | None:
    if value is not None and (not value.startswith("/") or "," in value or ":" in value):
        raise ValueError(f"{value!r} is not an absolute folder (no ',' or ':'), e.g. /var/spool/slurmd/pmix")
    return value


class RuntimeSite(Frozen):
    """One runtime as the site has it: extra arguments for it, what every container of it binds,
    and Slurm's PMIx folder, which a launcher with ``--mpi=pmix`` needs inside (``config.spec``)."""

    args: tuple[str, ...] = Field(default=(), description="extra arguments, e.g. [--set-env=/etc/ch.env]")
    mounts: tuple[Mount, ...] = Field(default=(), description="bound in every job's container")
    pmix_dir: Annotated[str | None, AfterValidator(_folder)] = Field(
        default=None, description="Slurm's PMIx folder, bound at its path (mpi.conf PMIxCliTmpDirBase, else TmpFS)")


class Container(Frozen):
    """A job's container: the runtime, the image, the image's Python and extra mounts."""

    runtime: Annotated[str | None, AfterValidator(_runtime)] = Field(
        default=None, description=f"{' | '.join(runtime_names())} | none")
    image: str | None = Field(default=None, min_length=1, description="a path, or what the runtime takes "
                              "(pyxis: a .sqsh with hpcdist, docs/containers.md)")
    mounts: tuple[Mount, ...] = Field(default=(), description="host folders bound inside, beside hpcdist's own")
    python: str | None = Field(default=None, min_length=1, description="the image's Python (default python3)")


def sites_runtimes(value: dict[str, RuntimeSite]) -> dict[str, RuntimeSite]:
    """The keys of a site's ``containers:``: registered runtimes."""
    unknown = sorted(set(value) - set(runtime_names()))
    if unknown:
        raise ValueError(f"unknown container runtime(s) {', '.join(unknown)}; hpcdist knows "
                         f"{', '.join(runtime_names())}")
    return value


def outermost(binds: list[Bind]) -> tuple[Bind, ...]:
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
    return replace(plan, binds=outermost(binds)), missing


IMAGE_PATHS = ("PATH", "LD_LIBRARY_PATH")  # what an image's programs and libraries are found by


def with_image_paths(plan: ContainerPlan) -> ContainerPlan:
    """A Charliecloud image directory's own ``PATH`` and ``LD_LIBRARY_PATH`` (from ``/ch/environment``,
    which ``ch-image`` writes from an OCI image's ``ENV``) set inside with ``--set-env=NAME=VALUE``:
    ch-run passes the host's (charliecloud.io ch-run(1), "Environment variables": the image's are
    set only with ``--set-env``), so a conda or NGC-derived image's ``/opt/.../bin`` would be missing.
    Only these two: the image's other values would win over the job's. An image without the file
    (built by ``cluster/image.sh``, or a SquashFS file): unchanged."""
    root = Path(plan.image)
    env = root / "ch" / "environment"
    if plan.runtime != "charliecloud" or not root.is_dir() or not env.is_file():
        return plan
    sets = []
    for line in env.read_text(errors="replace").splitlines():
        name, eq, value = line.partition("=")
        if eq and name in IMAGE_PATHS and "$" not in value:  # ch-run expands $ in --set-env values
            sets.append(f"--set-env={name}={value}")
    return replace(plan, args=(*sets, *plan.args)) if sets else plan



def placed(box: ContainerPlan, mounts: Sequence[str]) -> ContainerPlan:
    """The job's container `box` checked on disk before anything is queued: the image is there,
    every one of its `mounts`' sources is (the site's for the runtime, then the job's), and a
    Charliecloud image directory has a folder for every bind (each moved onto the image's empty
    mount point that holds it, ``fold_onto_image``), and is given its own ``PATH`` and
    ``LD_LIBRARY_PATH`` (``with_image_paths``)."""
    runtime = get_runtime(box.runtime)
    if (runtime.image_is_path or box.image.startswith(("/", "./"))) and not Path(box.image).exists():
        raise SubmitError(f"container.image {box.image!r} does not exist here; give the path of the image "
                          f"(a {box.runtime} image on shared storage), e.g. --set container.image=/shared/images/NAME")
    for mount in mounts:
        source = Bind.parse(mount).source
        if not Path(source).exists():
            raise SubmitError(f"container mount {mount!r}: {source} does not exist here; "
                              f"make it, or drop it from container.mounts")
    bad = next((p for p in runtime.listed_paths(box, os.getcwd()) if "," in p), None)
    if bad is not None:  # pyxis's and Apptainer's binds are one comma-separated list (hpcdist.containers)
        raise SubmitError(f"{bad!r} has a comma, which {box.runtime} reads as the end of a bind in its list of "
                          f"mounts; {'submit from' if bad == os.getcwd() else 'use'} a path without one")
    folded, missing = fold_onto_image(box)
    if missing:
        made = " ".join(f"{box.image.rstrip('/')}{t}" for t in missing)
        raise SubmitError(f"image {box.image} has no folder to bind {', '.join(missing)} onto (Charliecloud binds "
                          f"only onto a folder the image has); make the mount point(s) once: mkdir -p {made}")
    return with_image_paths(folded)

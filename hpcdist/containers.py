"""Container runtimes by name: how a launch line puts each rank inside an image (shared side).

One class per runtime, registered by name as the launchers are (``hpcdist.launchers``); the
launcher stays outside the image and each rank's Python runs inside it. A runtime owns:

- ``wrap(plan)``: the words before the image's Python on the launch line (``ch-run -b SRC:DST
  IMAGE --``, ``apptainer exec --bind ... IMAGE``, ``podman run ... IMAGE``);
- ``srun_flags(plan)``: options of srun itself, for a runtime that is an srun plugin (pyxis:
  ``--container-image``, ``--container-mounts``); such a runtime needs a launcher that starts its
  ranks with srun (``srun_only``);
- ``prelude()``: shell lines the job script runs first (Charliecloud: ``$USER``, which ch-run needs).

Charliecloud 0.31 binds only onto a folder the image has: ``config.container.fold_onto_image``
places its binds on the image's mount points before the line is written.

What crosses the boundary: every runtime here passes the environment through (Slurm's, PMIx's,
the launcher's variables, the job's ``env``); the binds put the storage roots, the job's own
mounts and the site's (PMIx's server folder, Slurm's ``TmpFS``) at the same paths inside; GPUs
come through the runtime's own switch when the job asks for them. Signals reach the rank:
``ch-run`` and pyxis run the rank as the step's process itself, Apptainer's and podman's
starters forward them.

Cheap on purpose (standard library only): the login node renders with it.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

# Set on every rank of a job whose ranks run in a container: the rank asks the batch step, which runs
# outside, for what needs Slurm's commands (``hpcdist.runtime.requeue``), and checks its versions.
CONTAINER_VAR = "HPCDIST_CONTAINER"
# The Python, hpcdist and torch versions that submitted the job, for the rank inside to compare.
SUBMITTED_WITH_VAR = "HPCDIST_SUBMITTED_WITH"


def versions() -> dict[str, str]:
    """This Python's, hpcdist's and torch's versions (torch's from its metadata: not imported);
    the job script carries the submitter's as ``python=X hpcdist=Y torch=Z``, which the rank
    inside compares with its own."""
    import sys
    from importlib import metadata

    from hpcdist._version import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "none"
    return {"python": ".".join(map(str, sys.version_info[:3])), "hpcdist": __version__, "torch": torch}


@dataclass(frozen=True)
class Bind:
    """One folder of the host at a path inside the image."""

    source: str
    target: str

    @classmethod
    def parse(cls, text: str) -> Bind:
        """``SRC`` (the same path inside) or ``SRC:DST``."""
        source, _, target = text.partition(":")
        return cls(source, target or source)

    def __str__(self) -> str:
        return self.source if self.source == self.target else f"{self.source}:{self.target}"


@dataclass(frozen=True)
class ContainerPlan:
    """What a runtime needs to wrap a rank: the image, its Python, the binds (hpcdist's own first,
    then the site's and the job's), the site's extra arguments for the runtime, and whether the job
    asked for GPUs."""

    runtime: str
    image: str
    python: str = "python3"
    binds: tuple[Bind, ...] = ()
    args: tuple[str, ...] = ()
    gpus: bool = False


class Runtime:
    """Base of every container runtime; subclasses set ``wrap`` or ``srun_flags``."""

    name: ClassVar[str]
    srun_only: ClassVar[bool] = False  # an srun plugin: only a launcher whose ranks srun starts can use it
    image_is_path: ClassVar[bool] = True  # the image is a file or folder that must exist (pyxis: also a registry ref)

    def wrap(self, plan: ContainerPlan) -> list[str]:
        """Shell words (quoted) before the image's Python on the launch line."""
        return []

    def srun_flags(self, plan: ContainerPlan) -> list[str]:
        """srun options (quoted) that put the step's tasks in the image."""
        return []

    def prelude(self) -> list[str]:
        """Shell lines the job script runs before the launch line; none by default."""
        return []


R = TypeVar("R", bound=type[Runtime])
_RUNTIMES: dict[str, Runtime] = {}


def register_runtime(name: str) -> Callable[[R], R]:
    """Class decorator: register one instance of the runtime under `name`; twice is an error."""

    def deco(cls: R) -> R:
        if name in _RUNTIMES:
            raise ValueError(f"container runtime {name!r} is registered twice")
        cls.name = name
        _RUNTIMES[name] = cls()
        return cls

    return deco


def get_runtime(name: str) -> Runtime:
    """The runtime registered as `name` (KeyError if none is)."""
    return _RUNTIMES[name]


def runtime_names() -> list[str]:
    return list(_RUNTIMES)


def _q(words: list[str] | tuple[str, ...]) -> list[str]:
    return [shlex.quote(w) for w in words]


@register_runtime("charliecloud")
class Charliecloud(Runtime):
    """``ch-run`` on an image directory (or SquashFS file), unprivileged; the environment passes
    through, ``/tmp`` and ``/etc/passwd``/``/etc/group`` are the host's. 0.31 binds only onto a
    folder the image has, and refuses to start without ``$USER`` (the launch line sets it)."""

    def wrap(self, plan: ContainerPlan) -> list[str]:
        binds = [f"--bind={b.source}:{b.target}" for b in plan.binds]
        return ["ch-run", *_q(binds), *_q(plan.args), shlex.quote(plan.image), "--"]

    def prelude(self) -> list[str]:
        return ['export USER="${USER:-$(id -un)}"  # ch-run will not start without it',
                "export OMPI_MCA_btl_vader_single_copy_mechanism=none  # Open MPI's CMA: refused in user namespaces"]


@register_runtime("apptainer")
class Apptainer(Runtime):
    """``apptainer exec`` (Singularity's successor; ``singularity`` takes the same words): binds
    as ``--bind SRC:DST``, GPUs with ``--nv``; the environment passes through."""

    command: ClassVar[str] = "apptainer"

    def wrap(self, plan: ContainerPlan) -> list[str]:
        binds = ["--bind", ",".join(f"{b.source}:{b.target}" for b in plan.binds)] if plan.binds else []
        return [self.command, "exec", *(["--nv"] if plan.gpus else []), *_q(binds), *_q(plan.args),
                shlex.quote(plan.image)]


@register_runtime("pyxis")
class Pyxis(Runtime):
    """NVIDIA's srun plugin over enroot: the image is srun's ``--container-image`` (a registry
    reference such as ``nvcr.io#nvidia/pytorch:24.10-py3``, or a ``.sqsh`` file), binds are
    ``--container-mounts``; enroot's hooks give the GPUs Slurm allocated; the environment passes
    through. srun only: mpirun's ranks cannot be put into it."""

    srun_only = True
    image_is_path = False

    def srun_flags(self, plan: ContainerPlan) -> list[str]:
        mounts = ",".join(f"{b.source}:{b.target}" for b in plan.binds)
        return _q([f"--container-image={plan.image}", *([f"--container-mounts={mounts}"] if mounts else []),
                   "--no-container-mount-home", *plan.args])


@register_runtime("podman")
class Podman(Runtime):
    """``podman run`` as podman-hpc uses it: the host's network, IPC and user (``--userns=keep-id``),
    the environment passed (``--env-host``), binds as ``-v SRC:DST``, GPUs through CDI."""

    image_is_path = False

    def wrap(self, plan: ContainerPlan) -> list[str]:
        binds = [w for b in plan.binds for w in ("-v", f"{b.source}:{b.target}")]
        gpus = ["--device", "nvidia.com/gpu=all"] if plan.gpus else []
        return ["podman", "run", "--rm", "--network=host", "--ipc=host", "--userns=keep-id", "--env-host",
                *_q(gpus), *_q(binds), *_q(plan.args), shlex.quote(plan.image)]

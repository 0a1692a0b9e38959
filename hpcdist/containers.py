"""Container runtimes by name: how a launch line puts each rank inside an image (shared side).

One class per runtime, registered by name as the launchers are (``hpcdist.launchers``); the
launcher stays outside the image and each rank's Python runs inside it. A runtime owns:

- ``wrap(plan)``: the words before the image's Python on the launch line (``ch-run -b SRC:DST
  IMAGE --``, ``apptainer exec --bind ... IMAGE``, ``podman run ... IMAGE``), ending with
  ``inside(plan)``, the ``env`` words run inside the image just before its Python;
- ``srun_flags(plan)``: options of srun itself, for a runtime that is an srun plugin (pyxis:
  ``--container-image``, ``--container-mounts``); such a runtime needs a launcher that starts its
  ranks with srun (``srun_only``);
- ``prelude(plan)``: shell lines the job script runs first (the cache home; Charliecloud: ``$USER``).

Charliecloud 0.31 binds only onto a folder the image has: ``config.container.fold_onto_image``
places its binds on the image's mount points before the line is written.

What crosses the boundary: the host's variables pass in, but each runtime lets an image's own
value win over some of them; every variable the ranks read (``ContainerPlan.names`` and
``task_names``) is named in the runtime's own way so that the job's wins (each class says how,
citing its documentation). The binds put the storage roots, Slurm's PMIx folder (``pmix_dir``),
the site's and the job's mounts at the same paths inside; GPUs come through the runtime's own
switch when the job asks for them. Signals reach the rank: ``ch-run`` and pyxis run the rank as
the step's process itself, Apptainer's and podman's starters forward them.

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


# The words a rank's start in a container needs whatever the runtime (the submit directory is Slurm's
# SLURM_SUBMIT_DIR, the cwd of the batch script and of its srun steps: expanded there, never quoted away).
SUBMIT_DIR = '"$SLURM_SUBMIT_DIR"'
# enroot's optional hook 50-slurm-pytorch.sh writes torch's env:// variables from Slurm's into every
# container of an image that sets PYTORCH_VERSION (every NGC PyTorch image): RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR, MASTER_PORT (= job id % 4536 + 61000). With them, a rank would take
# the "env" launcher table (hpcdist.launchers.UNOWNED_TABLES), before srun's own, and rank 0
# would serve the store on that fixed port instead of hpcdist's rendezvous: they are unset inside.
# https://github.com/NVIDIA/enroot/blob/master/conf/hooks/extra/50-slurm-pytorch.sh
ENROOT_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ContainerPlan:
    """What a runtime needs to wrap a rank: the image, its Python, the binds (hpcdist's own first,
    then the site's and the job's), the site's extra arguments for the runtime, and whether the job
    asked for GPUs; computed from the job and its site without I/O (``config.spec.plan_for``).

    What must win over the image's own values: `names`, the job-wide variables (the job's and
    site's ``env``, ``env_passthrough``, hpcdist's and submitit's own), and `task_names`, the
    per-task ones the launcher's environment table reads (``hpcdist.launchers``: Slurm's, PMIx's).
    `home`: a writable folder under the job's scratch, the rank's ``$HOME`` (Triton's, pip's and
    Hugging Face's caches); `pythonpath`/`usersite`: whether the site sets ``PYTHONPATH`` /
    ``PYTHONNOUSERSITE`` itself (else the host's path is dropped and user site-packages ignored).
    `pmix_dir`: Slurm's PMIx folder to bind (``--mpi=pmix``); `infiniband`: the site has HCAs."""

    runtime: str
    image: str
    python: str = "python3"
    binds: tuple[Bind, ...] = ()
    args: tuple[str, ...] = ()
    gpus: bool = False
    names: tuple[str, ...] = ()
    task_names: tuple[str, ...] = ()
    home: str | None = None
    pythonpath: bool = False
    usersite: bool = False
    pmix_dir: str | None = None
    infiniband: bool = False


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

    def prelude(self, plan: ContainerPlan) -> list[str]:
        """Shell lines the job script runs before the launch line: the cache home made."""
        return [f"mkdir -p -m 700 {shlex.quote(plan.home)}  # the ranks' $HOME inside"] if plan.home else []

    def listed_paths(self, plan: ContainerPlan, submit_dir: str) -> list[str]:
        """The paths this runtime writes into one comma-separated list (a comma in one would cut it
        in two, so ``config.container.placed`` refuses it); none by default."""
        return []

    def inside(self, plan: ContainerPlan, unset: tuple[str, ...] = ()) -> list[str]:
        """``env`` words run inside the image just before its Python: set last, they win over
        whatever the image and the runtime set (env(1), POSIX). ``PYTHONPATH`` dropped (the host's,
        from a ``module load`` or a venv, would shadow the image's packages) and user
        site-packages ignored (``PYTHONNOUSERSITE``, docs.python.org/3/using/cmdline.html), unless
        the site's or job's env sets them; ``HOME`` the writable cache home."""
        drop = [*unset, *([] if plan.pythonpath else ["PYTHONPATH"])]
        sets = [*([] if plan.usersite else ["PYTHONNOUSERSITE=1"]), *([f"HOME={plan.home}"] if plan.home else [])]
        return ["env", *_q([w for name in drop for w in ("-u", name)]), *_q(sets)]


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


def _names(plan: ContainerPlan, per_task: bool) -> list[str]:
    return sorted({*plan.names, *(plan.task_names if per_task else ())})


@register_runtime("charliecloud")
class Charliecloud(Runtime):
    """``ch-run`` on an image directory (or SquashFS file), unprivileged; the environment passes
    through (ch-run(1): the image's own variables are not set without ``--set-env``), ``/tmp`` and
    ``/etc/passwd``/``/etc/group`` are the host's, so is ``$HOME``. 0.31 binds only onto a folder
    the image has, and refuses to start without ``$USER`` (the launch line sets it)."""

    def wrap(self, plan: ContainerPlan) -> list[str]:
        binds = [f"--bind={b.source}:{b.target}" for b in plan.binds]
        return ["ch-run", *_q(binds), *_q(plan.args), shlex.quote(plan.image), "--", *self.inside(plan)]

    def prelude(self, plan: ContainerPlan) -> list[str]:
        # Open MPI's CMA single-copy is refused in user namespaces: 4.x names it in vader, 5.x in sm
        # (docs.open-mpi.org/en/v5.0.x/release-notes/changelog/v5.0.x.html: "vader" renamed "sm")
        return ['export USER="${USER:-$(id -un)}"  # ch-run will not start without it',
                "export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl_sm_single_copy_mechanism=none"]


@register_runtime("apptainer")
class Apptainer(Runtime):
    """``apptainer exec`` (Singularity's successor; ``singularity`` takes the same words).

    apptainer.org/docs/user/main/environment_and_metadata.html: the host's variables pass in, but
    one the image sets (Docker ``ENV``, ``%environment``) wins over the host's of the same name,
    unless given with ``--env`` or as ``APPTAINERENV_NAME``. hpcdist uses the second, exported by
    the job script from the variable's value at run time: ``--env`` is a pflag string-to-string map
    that splits a value with a second ``=`` at its commas (the H100 site's
    ``NCCL_IB_HCA==mlx5_0,...``), and it would write a pass-through secret's value on the line.
    Only job-wide names: the batch script's ``SLURM_PROCID`` is the batch step's, not a rank's.
    ``--no-home``: the user's home is not bound (its ``~/.local`` would shadow the image's
    packages); ``--bind`` binds at the same paths; the working directory is the submit directory,
    which apptainer binds and enters by default; ``--nv`` adds the driver for a GPU job."""

    command: ClassVar[str] = "apptainer"

    def wrap(self, plan: ContainerPlan) -> list[str]:
        binds = ["--bind", ",".join(f"{b.source}:{b.target}" for b in plan.binds)] if plan.binds else []
        return [self.command, "exec", *(["--nv"] if plan.gpus else []), "--no-home", *_q(binds), *_q(plan.args),
                shlex.quote(plan.image), *self.inside(plan)]

    def listed_paths(self, plan: ContainerPlan, submit_dir: str) -> list[str]:
        return [p for b in plan.binds for p in (b.source, b.target)]  # --bind A:B,C:D

    def prelude(self, plan: ContainerPlan) -> list[str]:
        names = " ".join(_q(_names(plan, per_task=False)))
        force = [f'for v in {names}; do if [ -n "${{!v+x}}" ]; then export "APPTAINERENV_$v=${{!v}}"; fi; done'
                 "  # over the image's values"] if names else []
        return [*super().prelude(plan), *force]


@register_runtime("pyxis")
class Pyxis(Runtime):
    """NVIDIA's srun plugin over enroot: the image is srun's ``--container-image`` (a ``.sqsh`` file
    made once with ``enroot import`` + ``enroot export``; a registry reference is imported again on
    every node, for every step and requeue), binds are ``--container-mounts``. srun only.

    Variables (pyxis README, ``--container-env``; ``spank_import_container_env`` in
    pyxis_slurmstepd.c): the host's are set, but the image's values win over them except for the
    names listed in ``--container-env``; every name the ranks read is listed, the launcher's
    per-task ones included (pyxis takes each task's own value). enroot's ``50-slurm-pytorch.sh``
    hook's variables are unset inside (``ENROOT_TORCH_VARS``). GPUs: enroot's ``98-nvidia.sh`` hook
    does nothing without ``NVIDIA_VISIBLE_DEVICES`` and gives only ``utility`` (no libcuda) without
    ``NVIDIA_DRIVER_CAPABILITIES``; NGC images set both, an image built from Debian and a pip torch
    does not: the job script sets them (the host's value wins in the hook) when the job asks for
    GPUs; Slurm's cgroup still limits the devices to the allocation. ``--no-container-mount-home``
    leaves ``$HOME`` an empty folder of a read-only root (enroot's ``ENROOT_ROOTFS_WRITABLE`` is
    ``no`` by default): ``HOME`` is the cache home. ``--container-workdir``: pyxis starts in the
    image's ``WORKDIR`` (``/workspace`` in NGC) otherwise, and chdir fails on a folder the container
    lacks, so the submit directory is bound too."""

    srun_only = True
    image_is_path = False

    def srun_flags(self, plan: ContainerPlan) -> list[str]:
        mounts = "".join(f"{b.source}:{b.target}," for b in plan.binds)
        # one word: the binds, then the submit directory at its own path (expanded by the batch shell)
        mount_word = shlex.quote(f"--container-mounts={mounts}") + f"{SUBMIT_DIR}:{SUBMIT_DIR}"
        return [shlex.quote(f"--container-image={plan.image}"), mount_word, f"--container-workdir={SUBMIT_DIR}",
                *_q(["--no-container-mount-home", f"--container-env={','.join(_names(plan, per_task=True))}",
                     *plan.args])]

    def listed_paths(self, plan: ContainerPlan, submit_dir: str) -> list[str]:
        # --container-mounts=A:B,C:D,SUBMIT_DIR:SUBMIT_DIR
        return [*(p for b in plan.binds for p in (b.source, b.target)), submit_dir]

    def wrap(self, plan: ContainerPlan) -> list[str]:
        return self.inside(plan, unset=ENROOT_TORCH_VARS)

    def prelude(self, plan: ContainerPlan) -> list[str]:
        gpus = ['export NVIDIA_VISIBLE_DEVICES="${NVIDIA_VISIBLE_DEVICES:-all}" '
                'NVIDIA_DRIVER_CAPABILITIES="${NVIDIA_DRIVER_CAPABILITIES:-compute,utility}"'
                "  # enroot's 98-nvidia.sh hook"] if plan.gpus else []
        return [*super().prelude(plan), *gpus]


@register_runtime("podman")
class Podman(Runtime):
    """``podman run`` as podman-hpc uses it: the host's network, IPC and user (``--userns=keep-id``).

    podman-run(1): ``--env NAME`` without a value takes the host's value, ``--env 'PREFIX*'`` every
    host variable with that prefix, and both win over the image's ``ENV`` (its ENVIRONMENT
    section); ``--env-host`` is not used, as it would also put the host's ``PATH`` and
    ``LD_LIBRARY_PATH`` over the image's. Each rank's podman runs in its own task, so the per-task
    names carry each rank's value. ``--device /dev/infiniband`` (the site has HCAs) and
    ``--ulimit host`` (the task's memlock limit, which Slurm propagates; NCCL's InfiniBand
    transport registers memory and falls back to sockets without it), ``--workdir`` the submit
    directory, bound at its path; GPUs through CDI (``nvidia.com/gpu=all``)."""

    image_is_path = False

    def wrap(self, plan: ContainerPlan) -> list[str]:
        binds = [w for b in plan.binds for w in ("-v", f"{b.source}:{b.target}")]
        gpus = ["--device", "nvidia.com/gpu=all"] if plan.gpus else []
        ib = ["--device", "/dev/infiniband"] if plan.infiniband else []
        env = [w for name in ("SLURM_*", "PMIX_*", *_names(plan, per_task=True)) for w in ("--env", name)]
        return ["podman", "run", "--rm", "--network=host", "--ipc=host", "--userns=keep-id", *_q(env),
                *_q([*gpus, *ib, "--ulimit=host", *binds]), "-v", f"{SUBMIT_DIR}:{SUBMIT_DIR}",
                f"--workdir={SUBMIT_DIR}", *_q(plan.args), shlex.quote(plan.image), *self.inside(plan)]

"""Submitting from a laptop (``hpcdist --on HOST``): what a job needs goes to the cluster, what it
wrote comes back, over the ssh connection of ``hpcdist.scheduler.ssh``.

The paths are the same on both sides: the site's storage roots are the cluster's, and the laptop
keeps its own copy of a job's files under the same paths (its job index, its ``logs`` and
``wait`` read them as on a login node). Before sbatch, ``send`` copies the job's folder (the
submission script, the code snapshot, submitit's pickle of the call) below its storage root,
never overwriting what the cluster has; ``fetch`` brings a job's folder (per-rank logs, result
pickles, progress) and its result file back. ``ready`` checks, before anything is queued, that
the cluster's Python (``site.python``, else this one's path) runs the same Python minor version,
hpcdist and cloudpickle as here, so a pickled call unpickles there: a mismatch is one line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpcdist.errors import SubmitError
from hpcdist.scheduler import ssh

if TYPE_CHECKING:
    from hpcdist.login.jobindex import JobRecord
    from hpcdist.login.plan import Plan

PICKLES = "*_submitted.pkl"  # the call the ranks wait for: sent after the job's key (hpcdist.runtime.signed_store)
_VERSIONS = ("import sys; import hpcdist._version as h\n"
             "try:\n import cloudpickle; c = cloudpickle.__version__\nexcept ImportError:\n c = 'none'\n"
             "print('%d.%d' % sys.version_info[:2], h.__version__, c)")


def active() -> bool:
    return bool(ssh.login())


def versions_here() -> str:
    from hpcdist._version import __version__

    try:
        import cloudpickle

        pickler = cloudpickle.__version__
    except ImportError:
        pickler = "none"
    return f"{sys.version_info[0]}.{sys.version_info[1]} {__version__} {pickler}"


def ready(plan: Plan) -> None:
    """Before anything is queued over ssh: the connection opens, the site keeps its files under
    absolute paths (the same on the cluster), no variable is to be passed from this shell, and
    the cluster's Python runs what this one does."""
    host = ssh.login()
    ssh.check()
    relative = [str(root) for root in plan.site.storage.roots if not root.is_absolute()]
    if relative:
        raise SubmitError(f"site {plan.site.name!r} keeps files under {', '.join(relative)}, relative to the folder "
                          f"you submit from; over ssh its storage roots must be absolute paths of the cluster "
                          f"(--set site.storage.logs=/scratch/$USER/hpcdist/logs, and results, checkpoints, scratch)")
    if plan.base.env_passthrough:
        raise SubmitError(f"env_passthrough ({', '.join(plan.base.env_passthrough)}): over ssh sbatch runs in the "
                          f"login node's environment, not this shell's; set them in the site's or job's env, "
                          f"or submit on the login node")
    python = plan.site.python or sys.executable
    try:
        proc = ssh.run([python, "-c", _VERSIONS], timeout=120.0)
    except Exception as exc:
        if isinstance(exc, SubmitError):
            raise
        raise SubmitError(f"ssh {host}: {python} did not answer: {exc}") from exc
    there, here = proc.stdout.strip(), versions_here()
    if proc.returncode != 0 or len(there.split()) != 3:
        said = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SubmitError(f"ssh {host}: {python} cannot run hpcdist there ({said}); name the cluster's Python that "
                          f"has hpcdist {here.split()[1]} with --set site.python=PATH")
    if there != here:
        names = ("Python", "hpcdist", "cloudpickle")
        diff = ", ".join(f"{n} {a} here, {b} there" for n, a, b in zip(names, here.split(), there.split(), strict=True)
                         if a != b)
        raise SubmitError(f"ssh {host}: {python} differs from this machine ({diff}); a pickled call needs the same "
                          f"on both: install the same versions, or --set site.python=PATH to one that has them")


def _split(folder: Path, roots: Iterable[Path]) -> tuple[Path, str]:
    """`folder` as (its storage root, the path below it): the root exists on the cluster, the
    folders below it are the user's, made with their modes."""
    for root in roots:
        try:
            rel = folder.relative_to(root)
        except ValueError:
            continue
        if rel.parts:
            return root, str(rel)
    return folder.parent, folder.name


def send(folder: Path, roots: Sequence[Path], pickles: bool = True) -> None:
    """Copy the job's `folder` below its storage root (one of `roots`) to the cluster; nothing
    there is overwritten. Without `pickles`, the calls the ranks wait for stay behind."""
    root, part = _split(Path(os.path.abspath(folder)), roots)
    ssh.put(root, [part], exclude=() if pickles else (PICKLES,))


def send_submitted(plan: Plan) -> None:
    """After sbatch named the job: its folder again, the keys first, then the pickled calls."""
    from submitit.core.utils import JobPaths

    folder = JobPaths.get_first_id_independent_folder(plan.folder)
    send(folder, plan.site.storage.roots, pickles=False)
    send(folder, plan.site.storage.roots)


def fetch(folders: Sequence[Path], files: Sequence[Path] = ()) -> None:
    """A job's folders and files as the cluster has them now."""
    ssh.get([Path(f) for f in folders], [Path(f) for f in files])


def fetch_record(record: JobRecord) -> None:
    fetch([Path(record.folder)], [Path(record.result)] if record.result else [])

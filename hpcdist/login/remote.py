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
    from hpcdist.config.site import Site
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
    """Before anything is queued over ssh: the connection opens, the site's storage roots are on
    the login node (the same paths as here), no variable is to be passed from this shell, the
    cluster's Python runs what this one does; then the job's inputs go up (``send_inputs``)."""
    host = ssh.login()
    ssh.check()
    roots_there(plan.site)
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
    send_inputs(plan)


def inputs(plan: Plan) -> list[Path]:
    """What the ranks read outside the job's folder, made here before sbatch: the code snapshot
    (``params.code_dir``), an Executor's pickled calls and its direct calls' spec files."""
    from hpcdist.config.contract import CALL_JOB_VAR

    found: dict[Path, None] = {}
    for task in plan.tasks:
        call = task.params.get("call")
        for value in (task.params.get("code_dir"), call if call not in (None, "-", "submitit") else None,
                      task.env.get(CALL_JOB_VAR)):
            if value:
                path = Path(value)
                found[path if path.is_dir() else path.parent] = None
    return [path for path in found if path.is_absolute() and path.exists()]


def send_inputs(plan: Plan) -> None:
    """The job's inputs (``inputs``) copied up before anything is queued, with a progress line:
    a rich bar on a terminal, else one line once they are there."""
    import time

    from hpcdist.console import Progress

    folders = inputs(plan)
    if not folders:
        return
    files = [f for folder in folders for f in folder.rglob("*") if f.is_file() and not f.is_symlink()]
    total = sum(f.stat().st_size for f in files)
    parts: dict[Path, list[str]] = {}
    for folder in folders:
        root, part = _split(Path(os.path.abspath(folder)), plan.site.storage.roots)
        parts.setdefault(root, []).append(part)
    started, what = time.monotonic(), "the code snapshot" if any(t.params.get("code_dir") for t in plan.tasks) \
        else "the calls"
    with Progress(f"{what} to {ssh.login()}", max(total, 1), unit="B", transient=False) as bar:
        for root, below in parts.items():
            ssh.put(root, below, sent=lambda size: bar.update(bar.done + size))
        bar.update(max(total, 1))
    if not sys.stderr.isatty():
        print(f"hpcdist: {what} sent to {ssh.login()}: {len(files)} files, {_size(total)} in "
              f"{time.monotonic() - started:.2f} s", file=sys.stderr)


def _size(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 1e6 else f"{count / 1e3:.1f} kB"


def roots_there(site: Site) -> None:
    """The site's storage roots on the login node, made there as hpcdist makes them here (the
    storage's folder mode) where missing, or one line saying why not: the roots are the
    cluster's paths, the same on both sides (a relative one is under the folder you submit from)."""
    made = ssh.run(["sh", "-c", 'm=$1; shift; for r; do test -d "$r" || mkdir -p -m "$m" "$r" || exit 1; done', "sh",
                    f"{site.storage.folder_mode:o}", *map(str, site.storage.roots)], timeout=60.0)
    if made.returncode:
        said = (made.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SubmitError(f"ssh {ssh.login()}: the login node cannot make site {site.name!r}'s storage roots ({said}); "
                          f"over ssh they are paths of the cluster (a relative one is under the folder you submit "
                          f"from, {Path.cwd()}): --set site.storage.logs=/scratch/$USER/hpcdist/logs, and results, "
                          f"checkpoints, scratch")


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

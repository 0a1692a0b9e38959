"""Files on shared storage that are never half-written where a reader could find them.

Write under a temporary name in the same directory, flush and fsync, ``os.replace`` onto the
final name, then fsync the directory so the rename itself survives a crash (as Orbax and
torch.distributed.checkpoint do). On any failure the temporary file is removed and the old
file, if any, is untouched.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_MARK = ".tmp-"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(final: Path) -> Path:
    """A hidden sibling of `final`, unique to this process; readers skip names with TMP_MARK."""
    return final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_path(final: Path, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path to write; on success it becomes `final` atomically and durably.

    With `mode` the temporary file is created empty with that mode before the writer gets it
    (writers truncate it, keeping the mode), so its contents are never readable by more people
    than `mode` allows; without, the process umask decides (``hpcdist.store.modes``).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(final)
    try:
        if mode is not None:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode))
            os.chmod(tmp, mode)  # the umask may have taken bits `mode` asked for
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def storage_umask(mask: int) -> Iterator[None]:
    """The process umask `mask` (a site's ``storage.umask``) while files are made on shared
    storage outside a rank (the submit side: code snapshot, submitit's folders, and, through
    sbatch, which passes the submitter's umask on, or the local controller, the job's own)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def make_folders(path: Path, mode: int, *, umask: bool = False) -> None:
    """`path` and every missing folder above it, each made with `mode` whatever the process umask
    (``Storage.folder_mode``: a storage root is as the site says, even when a command that does
    not set the storage umask, such as a node mark from a login shell, makes it first), or, with
    `umask`, less what the umask takes. Folders that exist are left as they are, as is one another
    process makes at the same moment."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode)
        except FileExistsError:
            continue
        if umask:
            continue
        os.chmod(folder, mode | (os.stat(folder).st_mode & stat.S_ISGID))  # the parent's setgid stays


def is_temporary(path: Path) -> bool:
    return TMP_MARK in path.name and path.name.startswith(".")

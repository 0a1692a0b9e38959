"""Whether hpcdist may unpickle, import or run a file: OpenSSH's ``StrictModes``, for shared storage.

A file is trusted when no one but this user (or root) could have written it: it is owned by this
user or root, is not writable by group or others, and so is every folder above it, up to `root`
(the storage root it lies under) or ``/``. A folder above that others may write is accepted only
when it is sticky (``chmod +t``: no one renames or removes another's entry in it), as the admin's
group root is (``chgrp GROUP ROOT; chmod 3770 ROOT``). Everything hpcdist reads back and would run
asks `trusted` first (submitit's pickles, an executor call, a result pickle, the code snapshot,
the rendezvous endpoint, a checkpoint folder); anything else is refused in one line naming the
file, its owner and its mode, and nothing is read.

In a user namespace (a rank in a Charliecloud or Apptainer container, run by an ordinary user)
the kernel shows every owner it does not map, root included, as the overflow uid (``nobody``):
there a folder above the file owned by ``nobody`` is taken for root's, with the same checks of
its mode. Another user's folder looks the same, so the job script checks submitit's pickle
outside first, with the real owners (``python -m hpcdist.runtime.submitted --check``).

``current_user`` (``hpcdist.config.site``'s, re-exported) is the one answer to "who am I" for paths
(the per-user folders of a shared storage root): from the process's uid, never from ``$USER``,
which a shell may leave as it was.
"""

from __future__ import annotations

import functools
import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcdist.config.user import current_user
from hpcdist.errors import HpcdistError

__all__ = ["UntrustedFileError", "current_user", "denied_hint", "describe", "opened_plain", "owner_name",
           "private_folder", "problem", "trusted"]


class UntrustedFileError(HpcdistError):
    """A file (or a folder above it) that another user could have written."""


def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def describe(path: Path, st: os.stat_result) -> str:
    """``PATH (owner bob, mode 0664, a fifo)``: what a refusal names."""
    kind = "" if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) else f", {_kind(st.st_mode)}"
    return f"{path} (owner {owner_name(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}{kind})"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file" if not stat.S_ISREG(mode) else "a file"


def problem(path: Path | str, root: Path | str | None = None, *, private: bool = False) -> str | None:
    """Why `path` cannot be trusted (one line), or None when it can. `private`: the file itself
    must also be unreadable by group and others (0600, as a rendezvous endpoint is). OSError
    (FileNotFoundError) when `path` cannot be looked at."""
    me = os.geteuid()
    path = Path(os.path.abspath(path))
    st = os.lstat(path)  # FileNotFoundError: the caller's "not there yet"

    if stat.S_ISLNK(st.st_mode):
        return f"{describe(path, st)} is a symbolic link: hpcdist reads no link it would run"
    if st.st_uid not in (me, 0):
        return f"{describe(path, st)} belongs to another user"
    if st.st_mode & 0o022:
        return f"{describe(path, st)} is writable by {_who(st.st_mode)}"
    if private and st.st_mode & 0o077:
        return f"{describe(path, st)} is readable by others; it must be 0600"
    top = Path(os.path.abspath(root)) if root is not None else Path("/")
    folder = path.parent
    while True:
        try:
            fst = os.stat(folder)
        except OSError as exc:
            return f"{folder} cannot be checked ({exc.strerror})"
        if fst.st_uid not in (me, 0, *_unmapped_root()) and not fst.st_mode & stat.S_ISVTX:
            return f"folder {describe(folder, fst)} above {path.name} belongs to another user"
        if fst.st_mode & 0o022 and not fst.st_mode & stat.S_ISVTX:
            return (f"folder {describe(folder, fst)} above {path.name} is writable by {_who(fst.st_mode)} "
                    f"and not sticky (anyone there may replace what is in it)")
        if folder == top or folder.parent == folder:
            return None
        folder = folder.parent


@functools.cache
def _unmapped_root() -> tuple[int, ...]:
    """The overflow uid, as root's files show in a user namespace that does not map root; () elsewhere."""
    try:
        ranges = [line.split() for line in Path("/proc/self/uid_map").read_text().splitlines()]
        if any(int(inside) == 0 for inside, _, _ in ranges) or not ranges:
            return ()
        return (int(Path("/proc/sys/kernel/overflowuid").read_text()),)
    except (OSError, ValueError):
        return ()


def _who(mode: int) -> str:
    return " and ".join(w for w, bit in (("its group", 0o020), ("everyone", 0o002)) if mode & bit)


def trusted(path: Path | str, root: Path | str | None = None, *, private: bool = False) -> None:
    """Raise UntrustedFileError (one line: file, owner, mode, what to do) unless `path` is trusted."""
    why = problem(path, root, private=private)
    if why is not None:
        raise UntrustedFileError(
            f"refusing to read {path}: {why}; hpcdist runs or unpickles only files no other user could "
            f"have written (yours, not group- or world-writable, in folders of yours)"
        )


def trusted_tree(folder: str | Path) -> None:
    """A code snapshot runs only when no other user could have written any of it: the folder,
    each file and folder in it, and the folders above."""
    trusted(folder)
    for base, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            trusted(Path(base) / name, folder)


@contextmanager
def opened_plain(path: Path | str) -> Iterator[tuple[int, os.stat_result]]:
    """`path` opened for reading, and its fstat, without following a link or waiting on a FIFO
    (O_NOFOLLOW | O_NONBLOCK): a file in a folder others may write, looked at before a byte of it
    is read. OSError as ``os.open`` raises it (ELOOP for a link, FileNotFoundError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        yield fd, os.fstat(fd)
    finally:
        os.close(fd)


def private_folder(folder: Path) -> Path:
    """`folder` made (with its parents) and kept 0700, owned by this user: a place no one else can
    read or write, for rendezvous endpoints and pickled calls. One that exists and is another's,
    or that others may enter, is refused."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UntrustedFileError(
            f"refusing to use {describe(folder, st)}: a private folder must be a folder of your own; "
            f"remove it (or ask its owner to) and run again"
        )
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def denied_hint(exc: OSError) -> str:
    """For a PermissionError on shared storage: whose folder refused, and what to do; else ""."""
    if not isinstance(exc, PermissionError) or not exc.filename:
        return ""
    folder = Path(os.path.abspath(exc.filename))
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    try:
        st = os.stat(folder if folder.is_dir() else folder.parent)
    except OSError:
        return ""
    if st.st_uid == os.geteuid():
        return ""
    where = folder if folder.is_dir() else folder.parent
    return (f" ({describe(where, st)} is not yours to write; a storage root shared by a group is made by the site's "
            f"admin: chgrp GROUP ROOT; chmod 3770 ROOT, after which each member's files go to ROOT/<user>)")

"""Whether hpcdist may unpickle, import or run a file: OpenSSH's ``StrictModes``, for shared storage.

A file is trusted when no one but this user (or root) could have written it: it is owned by this
user or root, is not writable by group or others, and so is every folder above it, up to `root`
(the storage root it lies under) or ``/``. Every such folder is owned by this user or root; a
folder that others may write is accepted only when it is sticky as well (``chmod +t``: no one
renames or removes another's entry in it), as the admin's group root is (``chgrp GROUP ROOT;
chmod 3770 ROOT``). Sticky excuses a folder's write bits, never another owner: the owner of a
sticky folder may rename anything in it.

Checked once, read from what was checked: `read_trusted` and `opened_trusted` walk the path from
``/`` one folder at a time (``openat(O_DIRECTORY|O_NOFOLLOW)``), follow a link on the way only
where no one but the user or root could repoint it (the link theirs, in a folder that passes the
test above; ``/scratch -> /lustre`` does, ``hpc -> /scratch/alice`` in a group's 2770 project
folder does not), check each open folder with ``fstat``, open the file with ``O_NOFOLLOW`` and
read it from that descriptor: a swap of a folder or of the file after the check changes nothing.
Everything hpcdist reads back and would run goes through them (submitit's pickles, an executor
call, a result pickle, the rendezvous endpoint and secret, a checkpoint folder); anything else is
refused in one line naming the file, its owner and its mode, and nothing is read.

In a user namespace (a rank in a Charliecloud or Apptainer container, run by an ordinary user)
the kernel shows every owner it does not map, root included, as the overflow uid (``nobody``):
there a folder above the file owned by ``nobody`` is taken for root's, with the same checks of
its mode. Another user's folder looks the same, so the job script checks submitit's pickle
outside first, with the real owners (``python -m hpcdist.runtime.task_runner --check``).

``current_user`` (``hpcdist.files.user``'s) is the one answer to "who am I" for paths: from the
process's uid, never from ``$USER``, which a shell may leave as it was.

Each user's folder in a shared root, and what a PermissionError there means (``denied_hint``), are
``files.roots``'s; the code snapshot's own walk (``kinds/snapshot.py``) stays there.
"""

from __future__ import annotations

import functools
import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from hpcdist.errors import HpcdistError
from hpcdist.files.user import current_user

__all__ = ["UntrustedFileError", "current_user", "cwd_problem", "describe", "importable_cwd",
           "load_pickle", "opened_plain", "opened_trusted", "owner_name", "private_folder", "problem", "read_trusted",
           "real_folder", "trusted", "trusted_folder"]

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_PATH", 0)
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


class UntrustedFileError(HpcdistError):
    """A file (or a folder above it) that another user could have written; `why` is the one line
    saying so, without the advice around it."""

    def __init__(self, message: str, why: str = "") -> None:
        super().__init__(message)
        self.why = why or message


class _Refused(Exception):
    """Why the walk stopped: the one line `problem` returns."""


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


def _who(mode: int) -> str:
    return " and ".join(w for w, bit in (("its group", 0o020), ("everyone", 0o002)) if mode & bit)


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


def _folder_problem(folder: Path, st: os.stat_result, below: str) -> str | None:
    if st.st_uid not in (os.geteuid(), 0, *_unmapped_root()):
        return f"folder {describe(folder, st)} above {below} belongs to another user (who may rename anything in it)"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"folder {describe(folder, st)} above {below} is writable by {_who(st.st_mode)} "
                f"and not sticky (anyone there may replace what is in it)")
    return None


def _file_problem(path: Path, st: os.stat_result, private: bool, folder: bool = False) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return f"{describe(path, st)} is a symbolic link: hpcdist reads no link it would run"
    if not (stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)):
        return f"{describe(path, st)} is not a {'folder' if folder else 'regular file'}"
    if st.st_uid not in (os.geteuid(), 0):
        return f"{describe(path, st)} belongs to another user"
    if st.st_mode & 0o022:
        return f"{describe(path, st)} is writable by {_who(st.st_mode)}"
    if private and st.st_mode & 0o077:
        return f"{describe(path, st)} is readable by others; it must be 0600"
    return None


_MAX_LINKS = 40  # the kernel's own limit on links followed in one path (ELOOP)


def _link_problem(link: Path, st: os.stat_result, target: str, holder: Path, holder_st: os.stat_result,
                  leads_to: Path) -> str | None:
    """Why the link `link` (lstat `st`, in the folder `holder`) may not be followed on the way to
    `leads_to`, or None: followed only where no one but this user or root can repoint it: the link
    is theirs, and so is the folder holding it, which others may not write unless it is sticky (in
    a sticky folder only a link's owner renames or removes it)."""
    mine = (os.geteuid(), 0, *_unmapped_root())
    if st.st_uid not in mine:
        why = f"the link belongs to {owner_name(st.st_uid)}"
    elif holder_st.st_uid not in mine:
        why = f"its folder {describe(holder, holder_st)} belongs to another user (who may rename anything in it)"
    elif holder_st.st_mode & 0o022 and not holder_st.st_mode & stat.S_ISVTX:
        why = (f"its folder {describe(holder, holder_st)} is writable by {_who(holder_st.st_mode)} and not "
               f"sticky")
    else:
        return None
    return (f"{describe(link, st)} -> {target}, on the way to {leads_to}, is a link others could repoint ({why}); "
            f"name the real path ({os.path.realpath(leads_to)}) instead, or keep the link in a folder only you "
            f"(or root) can write")


def _descend(stack: ExitStack, folder: Path, leads_to: Path) -> list[tuple[Path, os.stat_result, int]]:
    """The absolute `folder` opened from ``/`` one folder at a time (``O_DIRECTORY|O_NOFOLLOW``):
    each folder's real path, fstat and descriptor (closed with `stack`), from ``/`` down. A link
    on the way is followed only where `_link_problem` finds none (its target read from the folder
    that holds it), so what is opened is what was checked; _Refused with the one line otherwise,
    FileNotFoundError when a part is not there."""
    fd = stack.enter_context(_closing(os.open("/", _FOLDER)))
    seen = [(Path("/"), os.fstat(fd), fd)]
    todo = list(folder.parts[1:])
    links = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":  # in a link's target: the real parent, as the kernel takes it
            if len(seen) > 1:
                seen.pop()
            continue
        holder, holder_st, fd = seen[-1]
        here = holder / part
        try:
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(part, dir_fd=fd)
        except FileNotFoundError as exc:
            raise FileNotFoundError(exc.errno, exc.strerror, str(here)) from None
        except OSError as exc:
            raise _Refused(f"folder {here} above {leads_to.name} cannot be opened ({exc.strerror})") from exc
        if stat.S_ISLNK(st.st_mode):
            why = _link_problem(here, st, target, holder, holder_st, leads_to)
            if why is not None:
                raise _Refused(why)
            links += 1
            if links > _MAX_LINKS:
                raise _Refused(f"{leads_to} goes through more than {_MAX_LINKS} links")
            if target.startswith("/"):
                seen = seen[:1]
            todo[:0] = target.split("/")
            continue
        try:
            fd = stack.enter_context(_closing(os.open(part, _FOLDER, dir_fd=fd)))
        except FileNotFoundError as exc:
            raise FileNotFoundError(exc.errno, exc.strerror, str(here)) from None
        except OSError as exc:  # ELOOP: a link put there after it was looked at; ENOTDIR; EACCES
            raise _Refused(f"folder {here} above {leads_to.name} cannot be opened ({exc.strerror})") from exc
        seen.append((here, os.fstat(fd), fd))
    return seen


@contextmanager
def _walk(path: Path | str, root: Path | str | None, private: bool,
          folder: bool) -> Iterator[tuple[int, os.stat_result]]:
    """`path` opened and checked (see the module): its descriptor and fstat. _Refused with the
    one line; FileNotFoundError when a part of it is not there."""
    path = Path(os.path.abspath(path))
    top = Path(os.path.realpath(root)) if root is not None else Path("/")
    with ExitStack() as stack:
        walked = _descend(stack, path.parent, path)  # a link above the file: the site's (/scratch -> /lustre), checked
        seen = [(here, st) for here, st, _ in walked]
        fd = walked[-1][2]
        for here, st in reversed(seen):  # from the file's folder up to `root` (or /)
            why = _folder_problem(here, st, path.name)
            if why is not None:
                raise _Refused(why)
            if here == top:
                break
        try:
            fd = stack.enter_context(_closing(os.open(path.name, _FOLDER if folder else _FILE, dir_fd=fd)))
        except FileNotFoundError as exc:
            raise FileNotFoundError(exc.errno, exc.strerror, str(path)) from None
        except OSError as exc:  # ELOOP (a link), ENOTDIR, EACCES
            try:
                st = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                raise _Refused(f"{path} cannot be opened ({exc.strerror})") from exc
            raise _Refused(_file_problem(path, st, private, folder)
                           or f"{describe(path, st)} cannot be opened ({exc.strerror})") from exc
        st = os.fstat(fd)
        why = _file_problem(path, st, private, folder)
        if why is not None:
            raise _Refused(why)
        yield fd, st


@contextmanager
def _closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _refusal(path: Path | str, why: str) -> UntrustedFileError:
    return UntrustedFileError(
        f"refusing to read {path}: {why}; hpcdist runs or unpickles only files no other user could "
        f"have written (yours, not group- or world-writable, in folders of yours or root's)", why
    )


def problem(path: Path | str, root: Path | str | None = None, *, private: bool = False) -> str | None:
    """Why `path` cannot be trusted (one line), or None when it can. `private`: the file itself
    must also be unreadable by group and others (0600, as a rendezvous endpoint is). OSError
    (FileNotFoundError) when `path` cannot be looked at."""
    try:
        with _walk(path, root, private, folder=os.path.isdir(path) and not os.path.islink(path)):
            return None
    except _Refused as exc:
        return str(exc)


def trusted(path: Path | str, root: Path | str | None = None, *, private: bool = False) -> None:
    """Raise UntrustedFileError (one line: file, owner, mode, what to do) unless `path` is trusted."""
    why = problem(path, root, private=private)
    if why is not None:
        raise _refusal(path, why)


@contextmanager
def opened_trusted(path: Path | str, root: Path | str | None = None, *,
                   private: bool = False) -> Iterator[tuple[int, os.stat_result]]:
    """`path` opened once and checked (UntrustedFileError otherwise): its descriptor and fstat,
    to read from (``os.fdopen(os.dup(fd))``, or ``/proc/self/fd/N`` for a library that takes a
    path: the same file, whatever is renamed meanwhile). FileNotFoundError when it is not there."""
    try:
        with _walk(path, root, private, folder=False) as opened:
            yield opened
    except _Refused as exc:
        raise _refusal(path, str(exc)) from None


def read_trusted(path: Path | str, root: Path | str | None = None, *, private: bool = False,
                 limit: int | None = None) -> bytes:
    """The bytes of `path`, read from the descriptor that was checked (`opened_trusted`). A file
    over `limit` bytes is refused."""
    with opened_trusted(path, root, private=private) as (fd, st):
        if limit is not None and st.st_size > limit:
            raise _refusal(path, f"{describe(Path(path), st)} is {st.st_size} bytes, more than the {limit} expected")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()


def load_pickle(path: Path | str) -> Any:
    """The object pickled in `path`, unpickled from the bytes `read_trusted` read: submitit's
    pickles, an executor call, a result. The one place hpcdist unpickles a file."""
    import pickle

    return pickle.loads(read_trusted(path))


@contextmanager
def trusted_folder(path: Path | str, root: Path | str | None = None) -> Iterator[Path]:
    """The folder `path`, checked and held open: ``/proc/self/fd/N``, through which its files are
    read from the folder that was checked (a rename of it, or above it, changes nothing)."""
    try:
        with _walk(path, root, False, folder=True) as (fd, _):
            yield Path(f"/proc/self/fd/{fd}")
    except _Refused as exc:
        raise _refusal(path, str(exc)) from None


def trusted_tree(folder: str | Path) -> None:
    """A code snapshot runs only when no other user could have written any of it: the folder and
    the folders above (`trusted_folder`), then each file and folder in it, looked at (``lstat``)
    through the folder held open: one walk from ``/``, not one per file."""
    folder = Path(os.path.abspath(folder))
    with trusted_folder(folder) as here:
        for base, dirs, files in os.walk(here):
            for name, is_dir in [*((d, True) for d in dirs), *((f, False) for f in files)]:
                held = Path(base) / name
                shown = folder / held.relative_to(here)
                why = _file_problem(shown, os.lstat(held), private=False, folder=is_dir)
                if why is not None:
                    raise _refusal(shown, why)


def real_folder(path: Path | str) -> Path:
    """The real path of the folder `path`, as the walk from ``/`` opened it, every link on the way
    checked (`_link_problem`: no one but this user or root could repoint it): what a job keeps of
    a path it goes back to, such as the code snapshot its ranks import from, so that a link
    repointed later changes nothing. UntrustedFileError naming the link; FileNotFoundError."""
    path = Path(os.path.abspath(path))
    try:
        with ExitStack() as stack:
            return _descend(stack, path, path)[-1][0]
    except _Refused as exc:
        raise UntrustedFileError(f"refusing to use {path}: {exc}", str(exc)) from None


def cwd_problem() -> str | None:
    """Why the working folder may not be on an import path, in one line (its owner and mode), or
    None when it may: another user could have put a module in it (a group's project folder, 2770;
    a folder of someone else's; one below such a folder), which would shadow the standard library,
    hpcdist or the user's own code. Every Python hpcdist starts has ``-P`` (``launchers.SAFE_PATH``),
    which leaves the working folder off its path; this says whether hpcdist may put it back."""
    try:
        return problem(os.getcwd())
    except OSError as exc:
        return f"the current folder cannot be looked at ({exc.strerror})"


def importable_cwd() -> list[str]:
    """The working folder as an import path entry (``python -m``'s), when no one else could write it."""
    return [] if cwd_problem() else [os.getcwd()]


@contextmanager
def opened_plain(path: Path | str) -> Iterator[tuple[int, os.stat_result]]:
    """`path` opened for reading, and its fstat, without following a link or waiting on a FIFO
    (O_NOFOLLOW | O_NONBLOCK): a file in a folder others may write, looked at before a byte of it
    is read. OSError as ``os.open`` raises it (ELOOP for a link, FileNotFoundError)."""
    fd = os.open(path, _FILE)
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

"""Which checkpoints a run resumes from: only those no other user could have written.

Resuming (``CheckpointStore.load_latest``, the newest-good-checkpoint search ``discovery.scan``,
``ctx.checkpoints.load_latest``, a training job's resume) reads only the run's own checkpoint
folder, opened once and checked with ``hpcdist.files.trust.trusted_folder`` (OpenSSH's
``StrictModes``: owned by this user or root, not writable by group or others, and so every folder
above it, one that others may write only when sticky). Every file is then read through that open
folder (`held` yields ``/proc/self/fd/N``), so a rename of the folder, or of one above it, between
the check and the read changes nothing: a few system calls, no second read. A folder that fails is
one CheckpointError naming it, its owner and mode, and what to do, and nothing is read from it.

Inside a folder that passes, only this user (or root) can rename or replace an entry, so an entry
checked once with ``lstat`` stays what was checked. A step file, a shard folder or file, or the
``latest`` pointer that another user owns (put there before the folder was closed, or by an
admin's copy), or that the group or everyone may write, is not resumed: the search skips it with
one warning naming it (`problem`) and goes on to the newest step that is the user's own.

A colleague's checkpoint named by its path (``params.init``, ``infer_gpt``'s ``checkpoint:``,
``hpcdist.store.read``) is data the user chose to read and is read as before, without these checks.

So that a run's own checkpoints always pass, hpcdist writes none that the group or everyone may
write, whatever the umask: folders are made without those bits (`make_folder`, the umask still
taking more) and a file written with them loses them before its rename (`drop_group_write`).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from hpcdist.errors import CheckpointError
from hpcdist.files import trust
from hpcdist.files.atomic import make_folders

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
SHARDS = ".shards"  # a sharded step's folder beside its index (``hpcdist.store.sharded.layout.shards_dir``)


def _mine(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def reason(st: os.stat_result, folder: bool = False, named: bool = True) -> str | None:
    """Why an entry with `st` (from ``lstat`` or ``fstat``) is not resumed from, or None. `named`:
    say that naming it by its path still reads it (a checkpoint, not the pointer)."""
    what, mode = "folder" if folder else "regular file", stat.S_IMODE(st.st_mode)
    kind_ok = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
    if kind_ok and _mine(st.st_uid) and not mode & 0o022:
        return None  # the common case: no owner's name looked up
    who = trust.owner_name(st.st_uid)
    facts = f"owner {who}, mode {mode:04o}"
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link ({facts}): never resumed; put the {what} itself there"
    if not kind_ok:
        return f"not a {what} ({facts}): never resumed"
    if not _mine(st.st_uid):
        start = ", or, to start from it, name it by its path (params.init)" if named else ""
        return (f"{facts}: {who}'s, not yours, so never resumed ({who} could have written anything in it); "
                f"move it out (or ask {who} or the site's admin to){start}")
    return (f"{facts}: writable by {'everyone' if mode & 0o002 else 'its group'}, so never resumed (another "
            f"user could have changed it); chmod go-w it if what is in it is yours")


def problem(path: Path, folder: bool = False) -> str | None:
    """Why the entry `path` of a held folder is not resumed from (``lstat``: a link is not followed),
    or None when it is this user's (or root's) and no one else may write it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "gone (removed while this run looked)"
    return reason(st, folder)


def step_problem(path: Path) -> str | None:
    """`problem` of the step file `path` and, for a sharded step, of its shard folder beside it."""
    why = problem(path)
    shards = path.with_name(path.stem + SHARDS)
    if why is None and os.path.lexists(shards) and (why := problem(shards, folder=True)):
        why = f"its shard folder {shards.name}: {why}"
    return why


def pointer_problem(path: Path) -> str | None:
    """Why the ``latest`` pointer `path` of a held folder is not believed, or None (also when absent)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return reason(st, named=False)


def open_own(path: Path, shown: Path | None = None) -> int:
    """`path` opened for reading (no link followed, no FIFO waited on), refused unless the file
    opened is this user's own (``fstat``, `reason`): its descriptor. `shown`: the name errors give."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        why = reason(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise CheckpointError(f"{shown or path}: {why}")
    return fd


def _refusal(directory: Path, exc: trust.UntrustedFileError) -> str:
    why = exc.why  # what the check that refused it found: no second walk
    try:
        st: os.stat_result | None = os.lstat(directory)
    except OSError:
        st = None
    if st is not None and not _mine(st.st_uid):
        who = trust.owner_name(st.st_uid)
        todo = (f"if it is not yours, move it aside (mv {directory} {directory}.{who}, or ask {who} or the site's "
                f"admin to) and run again, which starts afresh; to start from {who}'s checkpoint, name it by its "
                f"path (params.init)")
    elif st is not None and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022:
        todo = f"if everything in it is yours, chmod go-w {directory}; else move it aside and run again"
    else:
        todo = ("every folder above it must be yours or root's, and one that others may write must be sticky "
                "(chmod +t; see docs/shared-sites.md)")
    return (f"refusing checkpoint folder {directory}: {why}; a run resumes from, and writes to, only a folder no one "
            f"else could have written, and nothing was loaded from this one; {todo}")


@contextmanager
def held(directory: Path | str) -> Iterator[Path]:
    """`directory` (a run's own checkpoint folder) checked and held open: ``/proc/self/fd/N``, the
    path to read its files through. A folder another user could have written is one CheckpointError
    (`_refusal`); FileNotFoundError when it is not there. A CheckpointError raised inside names
    `directory`, not the descriptor's path. A link to the folder is followed, as links above a
    file are (the folder it leads to is what is checked)."""
    directory = Path(os.path.abspath(directory))
    real = Path(os.path.realpath(directory))
    with ExitStack() as stack:
        try:
            here = stack.enter_context(trust.trusted_folder(real))
        except trust.UntrustedFileError as exc:
            raise CheckpointError(_refusal(real, exc)) from None
        try:
            yield here
        except CheckpointError as exc:
            exc.args = (shown(str(exc), here, directory),)  # the same error (a ChecksumError stays one), renamed
            raise


def shown(text: str, here: Path, directory: Path) -> str:
    """`text` with the held folder's descriptor path (`here`) put back as `directory`."""
    return re.sub(re.escape(str(here)) + r"(?![0-9])", lambda _: str(directory), text)


def check_folder(directory: Path | str) -> None:
    """Raise `held`'s CheckpointError unless `directory` is a checkpoint folder of this user's."""
    with held(directory):
        pass


def make_folder(directory: Path) -> None:
    """`directory` and the folders above it that are missing, made without group or world write
    (mode 0755, less what the umask takes): a run's own checkpoints are never refused for it. One
    that is there already (the run's claim made it) is left as it is, at the cost of one stat."""
    if not os.path.isdir(directory):
        make_folders(directory, 0o755, umask=True)


def drop_group_write(path: Path) -> None:
    """Take group and world write off the file `path` just written (a umask such as 002 gave them)."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o022:
        os.chmod(path, mode & ~0o022)

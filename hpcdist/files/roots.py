"""A site's storage roots as this user may use them: one line for a root she cannot read or write.

Every door to a site's storage asks here before it touches a byte: a submit and an
``hpcdist.Executor`` (``ready``, before the user's folders are made), ``hpcdist.init`` on the
nodes, and the readers of what the group shares there (the node health record, through
``explain``). A root she cannot use, or cannot make, is one ``StorageDenied`` naming the root, the
folder that refuses (its owner and mode), the key to set (``site.storage.X``) and ``hpcdist site
init`` for a site of her own: the shipped sites' roots are their admin's, and a copy of one refuses
her the same way until she edits its roots. The CLI prints it as one line; the Python API raises it.

Checked with ``os.access`` down from ``/``, one folder at a time, so the folder named is the first
one that refuses, not the last one ``pathlib`` happened to touch. (Root passes every check, as
the kernel lets it.)

A root that others may write holds one folder per user (``<root>/<user>``), which must be the
user's own: `own_folder` makes it, or refuses one another user made, naming who; `own_folders`
does so for every root, and refuses a root reached through a link another user could repoint
(the test of ``hpcdist.files.trust``). A PermissionError met on shared storage anyway (a submit,
the CLI) gets its one line here too (`denied_hint`): whose folder refused, and what to do.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from hpcdist.errors import ConfigError
from hpcdist.files.trust import UntrustedFileError, describe, owner_name, real_folder
from hpcdist.files.user import current_user

ROOTS = ("results", "checkpoints", "scratch", "logs")


class StorageDenied(ConfigError):
    """A storage root of the site that this user cannot read, write or make."""


def problem(storage: Any, name: str, write: bool = True) -> str | None:
    """Why this user cannot use root `name` of `storage` (read it, and write it when `write`), in
    words naming the folder that refuses, its owner and mode; None when she can."""
    return refusal(getattr(storage, name), write)


def refusal(path: str | Path, write: bool = False) -> str | None:
    """Why this user cannot read `path` (and write it when `write`; make it, where it is missing):
    the first folder down from ``/`` that refuses her, its owner and mode; None when nothing does."""
    from hpcdist.files.trust import describe

    base = Path(os.path.abspath(path))
    here = Path(base.anchor)
    for part in base.parts[1:]:
        below = here / part
        try:
            st = os.stat(below)
        except FileNotFoundError:
            if not write or os.access(here, os.W_OK | os.X_OK):
                return None  # nothing to read yet; or made by the first writer
            return f"{base} does not exist and cannot be made: {describe(here, os.stat(here))} is not yours to write"
        except OSError as exc:
            return f"{base}: {exc.strerror}"
        here = below
        if here != base and not os.access(here, os.X_OK):
            return f"{base} is inside {describe(here, st)}, which is not yours to enter"
    read = os.R_OK | (os.X_OK if os.path.isdir(base) else 0)
    wanted = [(what, bits) for what, bits in (("read", read), ("write", os.W_OK)) if write or what == "read"]
    missing = [what for what, bits in wanted if not os.access(base, bits)]
    if not missing:
        return None
    return f"{describe(base, os.stat(base))} is not yours to {' and '.join(missing)}"


def line(site: str, name: str, why: str) -> str:
    """The one line: what refuses, and what to do (the key, or a site of her own)."""
    return (f"site {site}: storage.{name}: {why}; set site.storage.{name} to a folder of yours (--set "
            f"site.storage.{name}=DIR, set={{'site.storage.{name}': DIR}} in Python, or in your copy of the site), "
            f"or write a site of your own with `hpcdist site init` (a root a group shares is made by the site's "
            f"admin: chgrp GROUP ROOT; chmod 3770 ROOT)")


def check(storage: Any, site: str, names: Iterable[str] = ROOTS, write: bool = True) -> None:
    """A StorageDenied for the first root of `names` this user cannot read (and write, when `write`)."""
    for name in names:
        why = problem(storage, name, write)
        if why is not None:
            raise StorageDenied(line(site, name, why))


def ready(storage: Any, site: str) -> None:
    """Every root checked (``check``), then this user's own folder made in each root others may
    write (`own_folders`): what a submit, an executor and ``hpcdist.init``
    ask before they write a byte there."""
    check(storage, site)
    own_folders(storage)


def explain(exc: OSError, storage: Any, site: str, write: bool = False) -> StorageDenied | None:
    """For an OSError met under one of `storage`'s roots: the StorageDenied of that root when the
    root itself is what refuses her; else None (the caller says what it says of the file)."""
    if not isinstance(exc, PermissionError) or not exc.filename:
        return None
    path = Path(os.path.abspath(exc.filename))
    for name in ROOTS:
        base = Path(os.path.abspath(getattr(storage, name)))
        if path == base or base in path.parents:
            why = problem(storage, name, write)
            if why is not None:
                return StorageDenied(line(site, name, why))
    return None


class StorageRoots(Protocol):
    """What `own_folders` reads of a site's storage (``hpcdist.config.site.Storage``), named by
    its shape: the config imports this package, so importing the config here would close a circle."""

    @property
    def folder_mode(self) -> int: ...

    def root(self, name: Any) -> Path: ...


def own_folder(folder: Path, mode: int) -> Path:
    """This user's folder of a storage root others may write (``<root>/<user>``): made with
    `mode` when missing, and otherwise (or when another user made it first, in the same moment)
    accepted only when it is a folder of this user's, checked with ``lstat``; a group- or
    world-writable one of hers is closed (another member could have put names there for her
    jobs to use). One another user made is refused, naming who and what to do."""
    try:
        folder.mkdir(mode)
        os.chmod(folder, mode | (os.stat(folder).st_mode & stat.S_ISGID))
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        who = owner_name(st.st_uid)
        raise UntrustedFileError(
            f"{describe(folder, st)} is your folder of a storage root shared by a group, but {who} made it: "
            f"hpcdist keeps your files only in a folder of your own (its owner could rename or replace "
            f"anything in it); {who} or the site's admin removes it (rm -r {folder}), then run again"
        )
    if st.st_mode & 0o022:
        os.chmod(folder, stat.S_IMODE(st.st_mode) & ~0o022)
    return folder


def own_folders(storage: StorageRoots) -> None:
    """`own_folder` for each root of `storage` that holds a folder per user: what a submit, an
    executor and ``hpcdist.init`` ask before they write a byte there."""
    from hpcdist.files.atomic import make_folders

    for name in ("logs", "results", "checkpoints", "scratch"):
        base, mine = getattr(storage, name), storage.root(name)
        _no_foreign_links(name, mine)  # before a folder is made through a link another could repoint
        if mine != base:
            make_folders(base, storage.folder_mode)
            own_folder(mine, storage.folder_mode)
        _no_foreign_links(name, mine)


def _no_foreign_links(name: str, root: Path) -> None:
    """A storage root reached through a link another user could repoint (one in a group's 2770
    project folder) is one UntrustedFileError naming the link: its jobs would write, and read
    back, wherever that user points it. A part not made yet is made as a real folder."""
    try:
        real_folder(root)
    except FileNotFoundError:
        pass
    except UntrustedFileError as exc:
        raise UntrustedFileError(f"storage.{name}: refusing {root}: {exc.why}", exc.why) from None


def denied_hint(exc: OSError) -> str:
    """For a PermissionError on shared storage: whose folder refused, and what to do; else ""."""
    if not isinstance(exc, PermissionError) or not exc.filename:
        return ""
    folder = Path(os.path.abspath(exc.filename))
    while not os.path.exists(folder) and folder.parent != folder:  # (False, not raising, where a folder above refuses)
        folder = folder.parent
    where = folder if os.path.isdir(folder) else folder.parent
    try:
        st = os.stat(where)
    except OSError:
        return ""
    if st.st_uid == os.geteuid():
        return ""
    if where.name == current_user():
        return (f" ({describe(where, st)} is your folder of a shared storage root, but {owner_name(st.st_uid)} "
                f"made it; they or the site's admin remove it: rm -r {where})")
    return (f" ({describe(where, st)} is not yours to write: {owner_name(st.st_uid)} made it their own; a storage "
            f"root shared by a group is made by the site's admin: chgrp GROUP ROOT; chmod 3770 ROOT, after which "
            f"each member's files go to ROOT/<user>)")

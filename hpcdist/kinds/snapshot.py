"""The code snapshot: the user's code copied to shared storage at submit, so the job runs that copy.

Editing the code after submitting (or before a requeue) then changes nothing in the job. In a
git checkout only the files git would keep are copied (tracked plus untracked-not-ignored, as
``git ls-files -co --exclude-standard`` lists them, in another user's checkout too), and a git
that fails there (not installed, a broken worktree) is an error, never a reason to copy
everything; elsewhere every file but caches and dot-files. Either way a file whose name looks
secret (``.env``, ``credentials.json``, ``*.pem``, ``id_rsa``, a name with ``secret``, ``token``
or ``password`` in it) or that is a link out of the tree is left out, and the caller says which. hpcdist's own output
is never copied, and not mentioned: the storage roots (and a job's own folder, an Executor's
``log_%j`` standing for every ``log_<id>`` it made) that lie inside the code folder, any
``hpcdist-out/`` (the local site's default storage, under the folder it is run from), and any
job's own files by their names (``<id>_submitted.pkl``, ``<id>_store.key``, ``<id>_<task>_log.out``),
so a second submit from the same folder copies no logs, results, checkpoints or earlier snapshots
of the first, nor warns of another Executor's files.
The copy is the user's alone (folders 0700, files 0600), whatever the storage mode: what kept a
file from the group may be a folder above the code, which the copy does not have; and it is
copied from a file opened without following links, so a file swapped for a link after the listing
copies nothing from outside the tree. A size limit keeps a data directory from being copied by
mistake. Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcdist.errors import ConfigError

OUTPUT_DIR = "hpcdist-out"  # the local site's storage (site_configs/local.yaml), under the folder hpcdist runs in
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
# Names that hold secrets by convention, and the words and suffixes that mark one.
_SECRET_NAMES = {
    ".env", ".envrc", ".netrc", "_netrc", ".pgpass", ".pypirc", ".npmrc", ".git-credentials", ".htpasswd", ".dockercfg",
    "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "known_hosts", "authorized_keys",
}
_SECRET_DIRS = {".aws", ".ssh", ".gnupg", ".docker", ".kube", ".azure", ".config/gcloud"}
_SECRET_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".kdbx", ".gpg", ".asc", ".env")
_SECRET_STEMS = re.compile(r"secret|credential|password|passwd|token(?!iz|s[._-])|api[-_]?key|private[-_]?key")
_SECRET_WORDS = re.compile(r"(^|[^a-z])(secrets?|credentials?|passwords?|passwd|token|api[-_]?keys?|private[-_]?key)"
                           r"([^a-z]|$)")


@dataclass
class Listing:
    """What a snapshot of one directory copies, and what it leaves out (path -> why)."""

    files: list[Path]
    left_out: dict[Path, str] = field(default_factory=dict)


def secret_reason(rel: Path) -> str | None:
    """Why the file at `rel` (relative to the code directory) looks like it holds a secret."""
    name = rel.name.lower()
    parts = [p.lower() for p in rel.parts]
    if any(d in parts for d in _SECRET_DIRS) or ".config/gcloud" in "/".join(parts):
        return "a credentials folder"
    if name in _SECRET_NAMES or name.startswith(".env.") or name.startswith("id_rsa"):
        return "a secret-looking name"
    if name.endswith(_SECRET_SUFFIXES):
        return "a secret-looking name"
    if name.endswith(".py"):  # code named for a secret (secret_check.py) stays; secrets.py does not
        word = _SECRET_WORDS.search(name)
        return "a secret-looking name" if word and word.group(0).strip("._-") == name[:-3] else None
    if _SECRET_STEMS.search(name):  # mytoken.txt, dbpassword.txt, AccessToken.txt: no word boundary needed
        return "a secret-looking name"
    return None


# A job's own files in its folder, whoever's folder it was: submitit's pickles and logs, hpcdist's
# store key (``hpcdist.config.paths``); ``123`` or an array task's ``123_4`` before the first ``_``.
_JOB_FILE = re.compile(r"\d+(?:_\d+)?_(?:store\.key|submitted\.pkl|submission\.sh"
                       r"|\d+_(?:log\.out|log\.err|result\.pkl))")
_ID_PATTERN = re.compile(r"%[jAatx]")  # submitit's and Slurm's placeholders in a folder's name (log_%j)


@dataclass(frozen=True)
class _Outputs:
    """hpcdist's output inside the code folder: folders relative to it, and folder-name patterns
    (an Executor's ``log_%j``: every ``log_<id>`` its jobs made)."""

    folders: set[Path]
    patterns: tuple[tuple[Path, re.Pattern[str]], ...] = ()


def _output_folders(src: Path, outputs: Sequence[Path]) -> _Outputs:
    """Which of `outputs` (hpcdist's output folders) lie inside `src`, relative to it; one that
    is `src` itself, or holds it, is no folder of the code's to leave out. A folder whose name
    holds a job id placeholder (``%j``) stands for every folder that name takes."""
    root = src.resolve()
    folders, patterns = set(), []
    for out in outputs:
        parts = out.parts
        at = next((i for i, part in enumerate(parts) if _ID_PATTERN.search(part)), None)
        fixed = (Path(*parts[:at]) if at else Path()) if at is not None else out
        where = fixed.resolve()
        if at is not None and (where == root or where.is_relative_to(root)):
            name = re.compile("".join("[^/]+" if _ID_PATTERN.fullmatch(piece) else re.escape(piece)
                                      for piece in re.split(r"(%[jAatx])", parts[at])))
            patterns.append((where.relative_to(root), name))
        elif where != root and where.is_relative_to(root):
            folders.add(where.relative_to(root))
    return _Outputs(folders, tuple(patterns))


def _is_output(rel: Path, outputs: _Outputs) -> bool:
    if OUTPUT_DIR in rel.parts or any(rel.is_relative_to(f) for f in outputs.folders):
        return True
    if _JOB_FILE.fullmatch(rel.name):
        return True
    for base, name in outputs.patterns:
        if rel.is_relative_to(base) and rel != base:
            below = rel.relative_to(base).parts
            if name.fullmatch(below[0]):
                return True
    return False


def files(src: Path, outputs: Sequence[Path] = ()) -> Listing:
    """The files of `src` to copy, relative to it (git's view in a checkout, else all but caches
    and dot-files), less secret-looking names, links that leave `src`, and hpcdist's own output
    (`outputs`, the storage roots, and any ``hpcdist-out/``), which is left out unsaid."""
    folders = _output_folders(src, outputs)
    listed = _git_files(src)
    left_out: dict[Path, str] = {}
    if listed is None:
        listed = []
        for dirpath, dirnames, filenames in os.walk(src):
            base = Path(dirpath).relative_to(src)
            dirnames[:] = [d for d in dirnames if not _is_output(base / d, folders)]  # never walked
            for d in sorted(dirnames):
                if d.startswith(".") and d not in _SKIP_DIRS:
                    left_out[base / d] = "a dot-folder"
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for f in sorted(filenames):
                if f.endswith(".pyc"):
                    continue
                if f.startswith(".") and secret_reason(base / f) is None:
                    left_out[base / f] = "a dot-file"
                    continue
                listed.append(base / f)
    root = src.resolve()
    kept = []
    for rel in (r for r in listed if not _is_output(r, folders)):
        why = secret_reason(rel)
        if why is None and not (src / rel).resolve().is_relative_to(root):
            why = "a link out of the tree"
        if why is None:
            kept.append(rel)
        else:
            left_out[rel] = why
    return Listing(kept, left_out)


def _checkout(src: Path) -> Path | None:
    """The git checkout holding `src`, if any (a `.git` folder or file there or above)."""
    for folder in (src.resolve(), *src.resolve().parents):
        if (folder / ".git").exists():
            return folder
    return None


def _git_files(src: Path) -> list[Path] | None:
    """git's view of `src`; None outside a checkout; inside one, a failing git is an error."""
    checkout = _checkout(src)
    if checkout is None:
        return None
    fix = "fix git there, or set params.snapshot=false to run the code where it is"
    try:
        proc = subprocess.run(  # a colleague's checkout (git's "dubious ownership") is listed too: its
            # code is what the user asked to run, and its config can start no program here (fsmonitor off)
            ["git", "-c", f"safe.directory={checkout}", "-c", "core.fsmonitor=false",
             "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=src, capture_output=True, check=False, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"params.snapshot: {src} is in the git checkout {checkout}, but git could not list its "
                          f"files ({type(exc).__name__}: {exc}); {fix}") from exc
    if proc.returncode != 0:
        said = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[0]
        raise ConfigError(f"params.snapshot: {src} is in the git checkout {checkout}, but `git ls-files` failed "
                          f"there ({said}); {fix}")
    names = [n for n in proc.stdout.decode().split("\0") if n]
    return [Path(n) for n in names if (src / n).is_file()]  # deleted-but-tracked files are skipped


def measure(src: Path, outputs: Sequence[Path] = ()) -> tuple[int, int]:
    """Bytes and number of files a snapshot of `src` would copy."""
    listed = files(src, outputs).files
    return sum((src / f).stat().st_size for f in listed), len(listed)


def make(src: Path, dest: Path, keep: str, max_mb: float,
         outputs: Sequence[Path] = ()) -> tuple[Path, dict[Path, str]]:
    """Copy `src` into `dest` (into ``dest/keep`` when `keep` names a package), less hpcdist's
    `outputs`; returns `dest` and what was left out (path relative to `src` -> why). The copy is
    the user's alone (folders 0700, files 0600, 0700 where the source is executable by its owner):
    what kept a file from the group in the source may be a folder above the code, which the copy
    does not have. Each file is opened without following a link and copied from what was opened:
    one swapped for a link (or a folder above it for one) since the listing stops the copy."""
    listing = files(src, outputs)
    size = sum((src / f).stat().st_size for f in listing.files)
    if size > max_mb * 1e6:
        raise ConfigError(
            f"params.snapshot: {src} holds {size / 1e6:.1f} MB in {len(listing.files)} files, over "
            f"params.snapshot_max_mb={max_mb:g}; leave data out of the code directory or raise the limit"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    target = dest / keep if keep else dest
    for folder in (dest, target):
        if not folder.is_dir():
            folder.mkdir(mode=0o700)
    root = src.resolve()
    top = os.open(root, _FOLDER)
    try:
        for rel in listing.files:
            for part in reversed(rel.parents[:-1]):
                if not (target / part).is_dir():
                    (target / part).mkdir(mode=0o700)
            _copy(top, root, src / rel, target / rel)
    except ConfigError:
        shutil.rmtree(dest, ignore_errors=True)  # no half snapshot left behind
        raise
    finally:
        os.close(top)
    return dest, listing.left_out


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


def _copy(top: int, root: Path, source: Path, out: Path) -> None:
    """`source` (a file of the tree `root`, opened as `top`) copied to the new file `out`: the
    file a link inside the tree names (its real path, read now) opened one folder at a time
    below `top` with ``O_NOFOLLOW``, checked with ``fstat`` for a regular file, and read from
    that descriptor; anything else is one ConfigError naming `source`."""
    real = Path(os.path.realpath(source))
    changed = (f"params.snapshot: {source} changed while the code snapshot was copied (now {{}}); nothing was "
               f"submitted: make sure no one else can write the code folder, then submit again")
    if not real.is_relative_to(root):
        raise ConfigError(changed.format(f"a link to {real}, out of the tree"))
    held: list[int] = []
    try:
        fd = top
        parts = real.relative_to(root).parts
        for i, part in enumerate(parts):
            fd = os.open(part, _FOLDER if i < len(parts) - 1 else _FILE, dir_fd=fd)
            held.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(changed.format("not a regular file"))
        mode = 0o700 if st.st_mode & stat.S_IXUSR else 0o600
        with os.fdopen(os.dup(fd), "rb") as f_in, \
                os.fdopen(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode), "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)
    except OSError as exc:  # ELOOP: a link in its place; ENOTDIR: a folder above it replaced
        raise ConfigError(changed.format(f"a link or not a folder: {exc.strerror}")) from exc
    finally:
        for fd in held:
            os.close(fd)

"""The code snapshot: the user's code copied to shared storage at submit, so the job runs that copy.

Editing the code after submitting (or before a requeue) then changes nothing in the job. In a
git checkout only the files git would keep are copied (tracked plus untracked-not-ignored, as
``git ls-files -co --exclude-standard`` lists them); elsewhere every file but caches. A size
limit keeps a data directory from being copied by mistake. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from hpcdist.errors import ConfigError

if TYPE_CHECKING:
    pass

_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def files(src: Path) -> list[Path]:
    """The files of `src` to copy, relative to it: git's view in a checkout, else all but caches."""
    listed = _git_files(src)
    if listed is not None:
        return listed
    out = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        base = Path(dirpath).relative_to(src)
        out += [base / f for f in sorted(filenames) if not f.endswith(".pyc")]
    return out


def _git_files(src: Path) -> list[Path] | None:
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=src, capture_output=True, check=False, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None  # not a git checkout (or no git): plain walk
    names = [n for n in proc.stdout.decode().split("\0") if n]
    return [Path(n) for n in names if (src / n).is_file()]  # deleted-but-tracked files are skipped


def measure(src: Path) -> tuple[int, int]:
    """Bytes and number of files a snapshot of `src` would copy."""
    listed = files(src)
    return sum((src / f).stat().st_size for f in listed), len(listed)


def make(src: Path, dest: Path, keep: str, max_mb: float) -> Path:
    """Copy `src` into `dest` (into ``dest/keep`` when `keep` names a package); returns `dest`."""
    listed = files(src)
    size = sum((src / f).stat().st_size for f in listed)
    if size > max_mb * 1e6:
        raise ConfigError(
            f"params.snapshot: {src} holds {size / 1e6:.1f} MB in {len(listed)} files, over "
            f"params.snapshot_max_mb={max_mb:g}; leave data out of the code directory or raise the limit"
        )
    target = dest / keep if keep else dest
    target.mkdir(parents=True, exist_ok=True)
    for rel in listed:
        out = target / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, out)  # contents only: the mode comes from the site's storage.mode
    return dest

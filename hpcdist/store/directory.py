"""A checkpoint directory's layout: step names, the ``latest`` pointer, listing and retention.

Files are ``step_<step:08d>.h5``; ``latest`` holds the name of the newest committed one and is
replaced atomically; temporaries (``hpcdist.store.atomic``) are hidden names a killed writer may
leave. Nothing here opens an HDF5 file: the format is ``hpcdist.store.checkpoints``.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

from hpcdist.store.atomic import atomic_path, is_temporary

POINTER = "latest"
_NAME = re.compile(r"^step_(\d{8})\.h5$")


def new_run_id() -> str:
    """A new run's id: its UTC start time, pid and random bits (unique across hosts, sorts by start)."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.h5"


def step_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def write_pointer(directory: Path, name: str) -> None:
    """Commit `name`: atomically replace `<directory>/latest` with it."""
    with atomic_path(Path(directory) / POINTER) as tmp:
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()


def read_pointer(directory: Path) -> tuple[Path | None, str]:
    """The file `latest` names and, when there is none, why (empty, missing, dangling...)."""
    pointer = Path(directory) / POINTER
    try:
        text = pointer.read_text().strip()
    except FileNotFoundError:
        return None, f"{pointer} does not exist"
    except OSError as exc:
        return None, f"{pointer} cannot be read ({exc.strerror})"
    if not text:
        return None, f"{pointer} is empty"
    if not _NAME.match(text):
        return None, f"{pointer} holds {text[:60]!r}, not a checkpoint name like step_00000010.h5"
    target = Path(directory) / text
    if not target.is_file():
        return None, f"{pointer} points to {text}, which does not exist"
    return target, ""


def checkpoints_in(directory: Path) -> list[Path]:
    """Final-named checkpoint files in `directory`, newest step first (temporaries excluded)."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: step_of(p) or 0, reverse=True)


def committed_in(directory: Path) -> list[Path]:
    """Checkpoint files no newer than the one `latest` names, newest first; none without a pointer."""
    latest, _ = read_pointer(directory)
    if latest is None:
        return []
    limit = step_of(latest) or 0
    return [p for p in checkpoints_in(directory) if (step_of(p) or 0) <= limit]


def temporaries_in(directory: Path) -> list[Path]:
    """Temporary files left in `directory` (a writer killed mid-write leaves one)."""
    if not Path(directory).is_dir():
        return []
    return sorted(p for p in Path(directory).iterdir() if is_temporary(p))


def prune(directory: Path, keep_last: int) -> tuple[Path, ...]:
    """Delete committed checkpoints older than the newest `keep_last`; never the committed one."""
    latest, _ = read_pointer(directory)
    if latest is None or keep_last < 1:
        return ()
    removed = []
    for path in committed_in(directory)[keep_last:]:
        if path != latest:
            path.unlink(missing_ok=True)
            removed.append(path)
    return tuple(removed)


def remove_temporaries(directory: Path) -> list[Path]:
    """Remove temporaries left by killed writers (call only when no writer of this job runs)."""
    gone = []
    for path in temporaries_in(directory):
        path.unlink(missing_ok=True)
        gone.append(path)
    return gone

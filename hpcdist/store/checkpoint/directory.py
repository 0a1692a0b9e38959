"""A checkpoint directory's layout: step names, the ``latest`` pointer, runs, listing and retention.

Files are ``step_<step:08d>.h5``; ``latest`` commits the newest one and is replaced atomically;
temporaries (``hpcdist.files.atomic``) are hidden names a killed writer may leave.

The pointer's last line is the committed file's name (a pointer of that one line is the format of
earlier builds); the lines before it are facts about the commit, ``<key> <value>``: ``run <id>``
names the *run* that committed it. A run is one line of checkpoints: a fresh start begins a new
one (`new_run_id`), a resume continues the run it resumed, and a requeued job is the same run.
Each file records its run too (the root attribute ``run_id``); only the files of the pointer's
run count as committed, so another run's files are never resumed or pruned in place of this
run's. A run that starts fresh in a directory that holds files first moves them, pointer
included, into ``previous/<their run>`` (`set_aside`). Which run a file belongs to is asked of
the caller (`run_of`): nothing here opens an HDF5 file, the format is ``hpcdist.store.checkpoint.single``.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcdist.files.atomic import atomic_path, fsync_path, is_temporary

POINTER = "latest"
PREVIOUS = "previous"  # where a fresh run moves the files it found (`set_aside`)
RUN_KEY = "run"  # the pointer's line naming the run that committed: "run <id>"
RunOf = Callable[[Path], str]  # a checkpoint file's run id ("" for a file of an earlier build)
_NAME = re.compile(r"^step_(\d{8})\.h5$")


def new_run_id() -> str:
    """A new run's id: its UTC start time, pid and random bits (unique across hosts, sorts by start)."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.h5"


def step_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def write_pointer(directory: Path, name: str, run: str = "") -> None:
    """Commit `name` (of run `run`): atomically replace `<directory>/latest`."""
    with atomic_path(Path(directory) / POINTER) as tmp:  # 0644 less the umask: no one else may write it
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), "w") as f:
            f.write((f"{RUN_KEY} {run}\n" if run else "") + name + "\n")
            f.flush()


@dataclass(frozen=True)
class Commit:
    """What the pointer says: the committed file (None with `problem` saying why), and its run.

    `run` is None when the pointer cannot say (missing, unreadable, empty), "" for a pointer of
    an earlier build (its run's files record no run either)."""

    path: Path | None
    run: str | None
    problem: str = ""


def read_commit(directory: Path) -> Commit:
    """The file `latest` names and the run that committed it; the run even when the file is gone."""
    pointer = Path(directory) / POINTER
    try:
        lines = [line.strip() for line in pointer.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return Commit(None, None, f"{pointer} does not exist")
    except (OSError, UnicodeDecodeError) as exc:
        return Commit(None, None, f"{pointer} cannot be read ({getattr(exc, 'strerror', None) or exc})")
    if not lines:
        return Commit(None, None, f"{pointer} is empty")
    facts = dict(line.partition(" ")[::2] for line in lines[:-1])
    run = facts.get(RUN_KEY, "").strip()
    name = lines[-1]
    if not _NAME.match(name) or any(" " not in line for line in lines[:-1]):
        return Commit(None, None, f"{pointer} holds {name[:60]!r}, not a checkpoint name like step_00000010.h5")
    target = Path(directory) / name
    if not target.is_file():
        return Commit(None, run, f"{pointer} points to {name}, which does not exist")
    return Commit(target, run)


def read_pointer(directory: Path) -> tuple[Path | None, str]:
    """The file `latest` names and, when there is none, why (empty, missing, dangling...)."""
    commit = read_commit(directory)
    return commit.path, commit.problem


def checkpoints_in(directory: Path) -> list[Path]:
    """Final-named checkpoint files in `directory`, newest step first (temporaries excluded)."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: step_of(p) or 0, reverse=True)


def committed_in(directory: Path, run_of: RunOf | None = None) -> list[Path]:
    """Checkpoint files no newer than the one `latest` names, newest first; none without a pointer.

    With `run_of`, only the files of the pointer's run (a file whose run cannot be read is not)."""
    commit = read_commit(directory)
    if commit.path is None:
        return []
    limit = step_of(commit.path) or 0
    older = [p for p in checkpoints_in(directory) if (step_of(p) or 0) <= limit]
    return older if run_of is None else [p for p in older if p == commit.path or _run(run_of, p) == commit.run]


def _run(run_of: RunOf, path: Path) -> str | None:
    try:
        return run_of(path)
    except Exception:  # unreadable: it is nobody's to prune or trust
        return None


def temporaries_in(directory: Path) -> list[Path]:
    """Temporary files left in `directory` (a writer killed mid-write leaves one)."""
    if not Path(directory).is_dir():
        return []
    return sorted(p for p in Path(directory).iterdir() if is_temporary(p))


def prune(directory: Path, keep_last: int, run_of: RunOf | None = None) -> tuple[Path, ...]:
    """Delete committed checkpoints older than the newest `keep_last`; never the committed one.

    With `run_of`, only files of the pointer's run count and are deleted: never another run's."""
    latest, _ = read_pointer(directory)
    if latest is None or keep_last < 1:
        return ()
    removed = []
    for path in committed_in(directory, run_of)[keep_last:]:
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


def set_aside(directory: Path, run: str | None) -> tuple[Path | None, list[Path]]:
    """Move every checkpoint file, its shard folder, and the pointer (a run's files, `run` if known)
    into ``<directory>/previous/run-<run>`` (or ``moved-<time>``), pointer first; (where, what moved).

    For a fresh start: afterwards the directory holds none of their files, so nothing of theirs
    can be resumed, pruned or mixed with the new run's; the files are kept, not deleted.
    """
    directory = Path(directory)
    files = checkpoints_in(directory)
    pointer = directory / POINTER
    if not files and not pointer.exists():
        return None, []
    # A sharded checkpoint's shard folders (``hpcdist.store.sharded.layout.shards_dir``) go with its
    # index, after it: the run stays whole and loadable there, and no later commit takes them for strays.
    folders = sorted(p for p in directory.glob("step_*.shards") if _NAME.match(p.name.removesuffix(".shards") + ".h5"))
    name = f"run-{run}" if run and "/" not in run and run not in (".", "..") else f"moved-{new_run_id()}"
    dest = directory / PREVIOUS / name
    while dest.exists():
        dest = directory / PREVIOUS / f"{name}-{uuid.uuid4().hex[:6]}"
    dest.mkdir(parents=True)
    moved = []
    for path in [pointer] * pointer.exists() + files + folders:  # the pointer first: no commit names a file mid-move
        os.replace(path, dest / path.name)
        moved.append(dest / path.name)
    fsync_path(dest)
    fsync_path(directory)
    return dest, moved

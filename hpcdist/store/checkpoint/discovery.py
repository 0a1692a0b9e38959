"""Finding the checkpoint to use in a directory: the newest committed one that verifies.

`scan` reports, as data, every file it skipped and why (truncated, flipped byte, written after
the last commit, written by another run, dangling or empty pointer, temporaries of killed
writers); `find_latest` logs the same. `resolve` is the non-verifying lookup for a user-given
path: a file, or the file a directory's ``latest`` names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint.directory import (
    POINTER,
    checkpoints_in,
    read_commit,
    read_pointer,
    step_of,
    temporaries_in,
)
from hpcdist.store.checkpoint.single import RUN_ATTR, Checkpoint, read, run_of
from hpcdist.store.checkpoint.tree import plain

log = logging.getLogger("hpcdist")


@dataclass
class Scan:
    """What `scan` found: the checkpoint to resume from and those skipped, with reasons."""

    latest: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    pointer_problem: str = ""
    temporaries: list[Path] = field(default_factory=list)
    checkpoint: Checkpoint | None = None  # `latest` as read while verifying, when `scan(keep=True)`
    run_id: str | None = None  # the run `latest` belongs to ("" for a file of an earlier build)

    def report(self) -> list[str]:
        lines = []
        if self.pointer_problem:
            lines.append(f"checkpoint pointer: {self.pointer_problem}; falling back to the files present")
        lines += [f"skipping checkpoint {p}: {why}" for p, why in self.skipped]
        lines += [f"ignoring temporary {p} (a writer was killed mid-write)" for p in self.temporaries]
        return lines

    def tell(self, report: Callable[[str], None] | None = None) -> Scan:
        """Each line of `report()` to `report` (the hpcdist log's warnings by default); returns self."""
        for line in self.report():
            (report or log.warning)(line)
        return self


def scan(directory: Path | str, *, keep: bool = False, mapped: bool = False) -> Scan:
    """The newest committed checkpoint in `directory` whose checksums verify, and what was skipped.

    With `keep`, the verified read of that checkpoint is kept (`Scan.checkpoint`), so a caller
    that loads it next does not read the file twice; with `mapped` too, its arrays are views of
    the file (``checkpoints.read``).
    Only files of the run the pointer names are candidates (any file when no pointer says which):
    another run's files are skipped, never resumed.
    """
    directory = Path(directory)
    files = checkpoints_in(directory)
    temporaries = temporaries_in(directory)
    commit = read_commit(directory)
    pointer, problem = commit.path, commit.problem
    if not files:
        has_pointer = (directory / POINTER).exists()
        return Scan(None, pointer_problem=problem if has_pointer else "", temporaries=temporaries)
    skipped: list[tuple[Path, str]] = []
    if pointer is not None:
        limit = step_of(pointer) or 0
        for p in files:
            if (step_of(p) or 0) > limit:
                skipped.append((p, f"written after the last commit ({POINTER} names {pointer.name})"))
        candidates = [p for p in files if (step_of(p) or 0) <= limit]
    else:
        candidates = files
    for path in candidates:
        try:
            if commit.run is not None and (other := run_of(path)) != commit.run:
                skipped.append((path, f"written by another run ({_run_name(other)}; {POINTER} names "
                                      f"{_run_name(commit.run)})"))
                continue
            loaded = read(path, verify=True, mapped=mapped and keep)
        except CheckpointError as exc:
            skipped.append((path, str(exc).removeprefix(f"{path}: ")))
            continue
        run = str(plain(loaded.attrs.get(RUN_ATTR, "")))
        return Scan(path, skipped, problem, temporaries, loaded if keep else None, run)
    return Scan(None, skipped, problem, temporaries)


def _run_name(run: str) -> str:
    return f"run {run}" if run else "a run of an earlier build, with no run id"


def find_latest(directory: Path | str, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest committed checkpoint that verifies; each skipped one is reported with why."""
    return scan(directory).tell(report).latest


def resolve(path: str | Path) -> Path:
    """The checkpoint file for `path`: the file itself, or the one a directory's ``latest`` names."""
    path = Path(path)
    if path.is_dir():
        target, why = read_pointer(path)
        if target is None:
            raise CheckpointError(
                f"checkpoint directory {path} has no committed checkpoint ({why}); "
                f"run the training job first or name a step_*.h5 file"
            )
        return target
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; give a step_*.h5 file or a checkpoint directory")
    return path

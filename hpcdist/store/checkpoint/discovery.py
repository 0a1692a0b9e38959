"""Finding the checkpoint to use in a directory: the newest committed one that verifies.

`scan` reports, as data, every file it skipped and why (truncated, flipped byte, written after
the last commit, written by another run, dangling or empty pointer, temporaries of killed
writers, another user's file or pointer); `find_latest` logs the same. Both read only the user's
own folder, through the folder held open (``hpcdist.store.checkpoint.owned``). `resolve` is the
non-verifying lookup for a user-given path (a colleague's too): a file, or the file a directory's
``latest`` names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint.directory import (
    POINTER,
    Commit,
    checkpoints_in,
    read_commit,
    read_pointer,
    remove_temporaries,
    step_of,
    temporaries_in,
)
from hpcdist.store.checkpoint.owned import held, pointer_problem, shown, step_problem
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
    removed: list[Path] = field(default_factory=list)  # temporaries of killed writers removed, `scan(clean=True)`

    def report(self) -> list[str]:
        """What was skipped or ignored, one line each (what was removed is said by `tell` only)."""
        lines = []
        if self.pointer_problem:
            lines.append(f"checkpoint pointer: {self.pointer_problem}; falling back to the files present")
        lines += [f"skipping checkpoint {p}: {why}" for p, why in self.skipped]
        lines += [f"ignoring temporary {p} (a writer was killed mid-write)" for p in self.temporaries]
        return lines

    def tell(self, report: Callable[[str], None] | None = None) -> Scan:
        """The temporaries removed, then each line of `report()`, to `report` (the hpcdist log's
        warnings by default); returns self."""
        removed = ([f"removed {len(self.removed)} temporary file(s) left by killed writers in "
                    f"{self.removed[0].parent}"] if self.removed else [])
        for line in removed + self.report():
            (report or log.warning)(line)
        return self


def scan(directory: Path | str, *, keep: bool = False, mapped: bool = False, within: Path | None = None,
         clean: bool = False) -> Scan:
    """The newest committed checkpoint in `directory` whose checksums verify, and what was skipped.

    With `keep`, the verified read of that checkpoint is kept (`Scan.checkpoint`), so a caller
    that loads it next does not read the file twice; with `mapped` too, its arrays are views of
    the file (``checkpoints.read``). With `clean`, the temporaries killed writers left are removed
    first (only when no writer of this directory runs) and said in one line (`Scan.removed`).
    Only files of the run the pointer names are candidates (any file when no pointer says which):
    another run's files are skipped, never resumed. Only this user's own are read at all
    (``hpcdist.store.checkpoint.owned``): a folder another user could have written is one
    CheckpointError, nothing read; a step file or pointer of another's in her own folder is
    skipped, said why. The folder is read through `within` when the caller holds it open
    (``owned.held(directory)``), else held here for the scan.
    """
    directory = Path(directory)
    if within is not None:
        return _shown(_scan(within, keep, mapped, clean), within, directory)
    if not directory.is_dir():
        return Scan(None)
    with held(directory) as here:
        return _shown(_scan(here, keep, mapped, clean), here, directory)


def _scan(directory: Path, keep: bool, mapped: bool, clean: bool) -> Scan:
    """`scan` of a held folder (paths through ``/proc/self/fd/N``; `_shown` names them as the user does)."""
    removed = remove_temporaries(directory) if clean else []
    skipped: list[tuple[Path, str]] = []
    files = []
    for p in checkpoints_in(directory):
        why = step_problem(p)
        if why is None:
            files.append(p)
        else:
            skipped.append((p, why))
    temporaries = temporaries_in(directory)
    why = pointer_problem(directory / POINTER)
    commit = Commit(None, None, f"ignoring {directory / POINTER}: {why}") if why else read_commit(directory)
    pointer, problem_ = commit.path, commit.problem
    if not files:
        has_pointer = (directory / POINTER).exists()
        return Scan(None, skipped, pointer_problem=problem_ if has_pointer else "", temporaries=temporaries,
                    removed=removed)
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
        return Scan(path, skipped, problem_, temporaries, loaded if keep else None, run, removed)
    return Scan(None, skipped, problem_, temporaries, removed=removed)


def _shown(found: Scan, here: Path, directory: Path) -> Scan:
    """`found` with the paths through the held folder `here` named as `directory`'s."""
    def named(path: Path) -> Path:
        return directory / path.name if path.parent == here else path

    if found.checkpoint is not None:
        found.checkpoint.path = named(found.checkpoint.path)
    return Scan(None if found.latest is None else named(found.latest),
                [(named(p), shown(why, here, directory)) for p, why in found.skipped],
                shown(found.pointer_problem, here, directory), [named(p) for p in found.temporaries],
                found.checkpoint, found.run_id, [named(p) for p in found.removed])


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

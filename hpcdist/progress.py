"""Rank 0's newest progress, for whoever waits on the job from the login node.

Rank 0 writes one small JSON file, ``progress.json``, into the job's log folder (atomically, at
most every ``EVERY_S`` seconds and at the last step); the waiter (``hpcdist submit --wait``,
``hpcdist wait``) reads it on each poll and shows one line. A file, not a socket: the login node
and the compute nodes share the storage and nothing else, and a stale file is harmless.

The runtime points ``HPCDIST_PROGRESS_FILE`` at the file on rank 0 only (``start``); every other
process (other ranks, the login node) has no such variable and ``report_progress`` does nothing.
``console.Progress`` reports each update, so training and benchmarks need no call of their own.
Standard library only: both sides of the flow import it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROGRESS_FILE_VAR = "HPCDIST_PROGRESS_FILE"
FILE_NAME = "progress.json"
EVERY_S = 2.0  # the most often rank 0 rewrites the file

_last_write = 0.0


def progress_file(log_folder: Path) -> Path:
    """Where a job's progress lives in its folder (``JobPaths.progress``)."""
    return Path(log_folder) / FILE_NAME


def start(log_folder: Path, is_main: bool) -> None:
    """Rank 0 of a job reports into `log_folder` from now on (the variable reaches its children,
    e.g. a ``python`` job's script); other ranks report nothing."""
    if is_main:
        os.environ[PROGRESS_FILE_VAR] = str(progress_file(log_folder))
    else:
        os.environ.pop(PROGRESS_FILE_VAR, None)


def report_progress(title: str, done: int, total: int | None = None, info: str = "", unit: str = "step") -> None:
    """`done` of `total` units of `title` are done; `info` is the newest figures in a few words
    (``loss 3.21  12,345 tok/s``). Cheap: does nothing off rank 0, and writes at most every
    ``EVERY_S`` seconds (always at the last unit). A failed write is ignored: progress is a hint."""
    global _last_write
    path = os.environ.get(PROGRESS_FILE_VAR)
    now = time.monotonic()
    if not path or (now - _last_write < EVERY_S and done != total):
        return
    _last_write = now
    data = {"time": time.time(), "title": title, "unit": unit, "done": done, "total": total, "info": info}
    from hpcdist.files.atomic import atomic_path  # on a rank, where the store is loaded anyway

    try:
        with atomic_path(Path(path)) as tmp:
            tmp.write_text(json.dumps(data))
    except OSError:
        pass


@dataclass(frozen=True)
class Report:
    """What rank 0 last reported, as read back from its file."""

    time: float
    title: str
    unit: str
    done: int
    total: int | None
    info: str

    def text(self) -> str:
        """One line: ``train step 120/400  loss 3.2100  12,345 tok/s``."""
        of = f"{self.done}/{self.total}" if self.total else str(self.done)
        return f"{self.title} {self.unit} {of}" + (f"  {self.info}" if self.info else "")


def read_progress(log_folder: Path) -> Report | None:
    """The newest report in `log_folder`, or None when there is none (yet) or it cannot be read."""
    try:
        data = json.loads(progress_file(log_folder).read_text())
        return Report(float(data["time"]), str(data["title"]), str(data["unit"]), int(data["done"]),
                      None if data["total"] is None else int(data["total"]), str(data["info"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None

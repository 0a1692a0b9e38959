"""A rank's last words: the one-line error it would have raised, kept where the summary finds it
when the rank itself is ended before it can raise (both sides: the rank writes, the login side reads).

Under NCCL a collective that times out raises nothing in Python: torch's watchdog aborts the
process (``hpcdist.runtime.abort``). Before that, the rank writes here what its error would have
said (which collective, which rank and node did not answer), and the per-rank summary of
``submit --wait`` and ``hpcdist wait`` shows it for a rank that left no result. Rank 0 of each
run removes the words an earlier run left (``clear_earlier``), as it does the stacks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpcdist.files.atomic import atomic_path


def write(path: Path, rank: int, host: str, error: str) -> None:
    """Record `error` (``SomeError: message``, one line) as rank `rank`'s on `host`, now."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"rank": rank, "host": host, "written": time.time(), "error": error}))


def read(path: Path) -> tuple[str, float] | None:
    """The error a rank left at `path` and when it wrote it, or None (no file, or not one of ours)."""
    try:
        data = json.loads(path.read_text())
        return str(data["error"]), float(data["written"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_earlier(folder: Path, launch: float) -> None:
    """Remove the last words written before `launch` (an earlier run's) from a job's folder."""
    for path in folder.glob("last_words_rank*.json"):
        got = read(path)
        if got is None or got[1] < launch:
            path.unlink(missing_ok=True)

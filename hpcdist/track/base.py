"""What every tracker implements (``Tracker``), what it is sent (``Item``), and the high-water
mark: the last step each tracker acknowledged, kept in the job's tracking folder, so a restart
that resumed an older checkpoint knows which steps it logs a second time."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

HIGH_WATER_FILE = "steps.json"


@dataclass(frozen=True)
class Item:
    """One thing to send: metrics at a step, parameters, tags (values that may change: the job's
    spec and site as JSON), or a file."""

    what: Literal["metrics", "params", "tags", "artifact"]
    step: int = 0
    values: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


class Tracker(Protocol):
    """One tracker's side of the job's run. ``send`` raises when the tracker cannot take the items
    (they are sent again later); it is called from one background thread only."""

    name: str

    def send(self, items: list[Item]) -> None: ...

    def finish(self, finished: bool) -> None:
        """The job ends (`finished`: completed) or leaves for a requeue: flush, close files."""
        ...


def read_high_water(folder: Path, name: str) -> int | None:
    """The last step tracker `name` took for this run before this restart (None: none yet)."""
    try:
        value = json.loads((folder / HIGH_WATER_FILE).read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def write_high_water(folder: Path, name: str, step: int) -> None:
    """Record `step` for tracker `name` (a temporary name, then rename: never half-written)."""
    path = folder / HIGH_WATER_FILE
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[name] = step
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)

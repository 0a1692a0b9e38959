"""The public API for the user's own code: ``ctx = hpcdist.init()``.

(Filled in below; ``attach`` / ``detach`` let a ``python`` job's ranks hand their bootstrap to
``init`` in the same process.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcdist.runtime.context import JobContext

_ACTIVE: list[JobContext] = []


def attach(ctx: JobContext) -> None:
    """Make `ctx` (a ``python`` job's bootstrap on this rank) what ``init`` builds on."""
    _ACTIVE[:] = [ctx]


def detach() -> None:
    _ACTIVE.clear()

"""What a failed step of ``train_gpt`` says, on the node: a collective that fails or hangs becomes
one ``JobError`` naming the step and what it was doing, the node that stopped answering, and the
last committed checkpoint a resubmission resumes from. The loop, its step log and its checkpoint
manager each wrap their collectives in ``named``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hpcdist.errors import HpcdistError, JobError
from hpcdist.runtime import abort
from hpcdist.runtime.rollcall import failure_message

if TYPE_CHECKING:
    from hpcdist.train.run import Run


def _newest_commit(r: Run) -> Path | None:
    """The checkpoint a resubmission would resume from: the directory's ``latest`` pointer, read
    from shared storage by any rank (a background save commits after the step that made it, so
    the run's own record can lag), else what this rank last saw committed."""
    try:
        return r.api.checkpoints.store.latest() or r.last_checkpoint
    except Exception:  # an unreadable pointer: the error message falls back to the run's record
        return r.last_checkpoint


@contextlib.contextmanager
def named(r: Run, what: str) -> Iterator[None]:
    """A failed collective becomes a JobError naming the step, the node that stopped answering
    and the last committed checkpoint, from which a resubmission resumes; so does one that NCCL's
    watchdog times out and ends the rank for (``hpcdist.runtime.abort``)."""

    def kept(_: str) -> str:
        committed = _newest_commit(r)
        return f"; resubmit to resume from {committed}" if committed else "; no checkpoint yet"

    try:
        with abort.phase(what, on_timeout=kept):
            yield
    except HpcdistError:
        raise
    except Exception as exc:
        message = failure_message(what, r.ctx.rank, r.ctx.hosts, exc, r.ctx.site, r.ctx.job_id)
        raise JobError(message + kept(message)) from exc

"""One error base for hpcdist and one subclass per stage of a job's flow.

The CLI prints any ``HpcdistError`` as one line (no traceback unless ``--debug``) and exits
non-zero, so every message says what was wrong, the value seen, and what to do; an error raised
from another keeps it as its cause (`cause_text` for the one line, the chain for `--debug`).
"""

from __future__ import annotations

from collections.abc import Iterator


class HpcdistError(Exception):
    """Base of every error hpcdist raises on purpose."""


class ConfigError(HpcdistError):
    """A site config or job spec is malformed, unknown or impossible."""


class RenderError(HpcdistError):
    """A job script cannot be rendered safely (e.g. a control character in a value)."""


class SubmitError(HpcdistError):
    """The scheduler refused the job, or its lifecycle could not be followed."""


class BootstrapError(HpcdistError):
    """Ranks could not be formed into a process group (missing rank, bad launch)."""


class JobError(HpcdistError):
    """A workload failed for a reason it can name (bad data, bad parameter at run time)."""


class CheckpointError(HpcdistError):
    """A checkpoint could not be written, found, or verified."""


class BenchmarkError(HpcdistError):
    """A benchmark cannot run as asked, or its result is below the site's minimum."""


def cause_text(exc: BaseException) -> str:
    """``Type: first line of its message`` (the type alone when it has none): the cause of a failure
    kept inside a one-line error message; the full chain stays on ``__cause__`` for ``--debug``."""
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then each exception it came from (its ``__cause__``, else its ``__context__``), once each."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__

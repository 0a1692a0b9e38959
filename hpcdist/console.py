"""What a person reads: tables and progress through rich, plain text where there is no terminal.

Reports build a borderless rich ``Table`` with ``table()`` and turn it into text with ``text()``;
when stdout is not a terminal (a pipe, a log, a test) that text has no colour codes and no
trailing blanks, so it reads, greps and splits as plain columns. ``Progress`` draws a bar when
stderr is a terminal, and otherwise writes a log line every few steps, or nothing.

rich is imported only when a table is rendered or a bar drawn.
"""

from __future__ import annotations

import io
import logging
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hpcdist.progress import report_progress

if TYPE_CHECKING:
    from rich.table import Table

# Wide enough that rich never wraps or shortens a cell: a table keeps its natural width.
_WIDTH = 10_000


def table(*columns: str, left: int | tuple[str, ...] = 1) -> Table:
    """A table in the nccl-tests look (no borders: a header line, then a line a row).

    Text columns are left-aligned (the first `left` columns, or those named in `left`), figures
    right-aligned. A header may span two lines (``"out-of-place\\ntime(us)"``).
    """
    from rich.table import Table

    t = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    for i, name in enumerate(columns):
        text_column = name in left if isinstance(left, tuple) else i < left
        t.add_column(name, justify="left" if text_column else "right", no_wrap=True)
    return t


def text(*renderables: Any, indent: int = 0) -> str:
    """What `renderables` print, as a string, each line indented by `indent` spaces; colour only
    when stdout is a terminal.

    Cells are literal text (no rich markup), so a node list like ``n[1-2]`` prints as it is.
    """
    from rich.console import Console

    tty = sys.stdout.isatty()
    buf = io.StringIO()
    console = Console(
        file=buf, width=_WIDTH, force_terminal=tty, color_system="standard" if tty else None,
        markup=False, highlight=False, emoji=False,
    )
    console.print(*renderables)
    return "".join(" " * indent + line.rstrip() + "\n" for line in buf.getvalue().splitlines())


class Progress:
    """Progress through `total` steps, for one rank (`show=False` on the others).

    On a terminal (stderr): a rich bar with the latest `info`, elapsed and remaining time. Elsewhere,
    as in a batch job's log: ``"{unit} N/total  info"`` through `log` every `every` steps and at
    the last, or nothing when `every` is 0. With ``unit="B"`` the steps are bytes (a copy's
    size and speed). Each update is also rank 0's progress report
    (``hpcdist.progress``). Use it as a context manager or call `close()`.
    """

    def __init__(
        self,
        title: str,
        total: int,
        *,
        start: int = 0,
        show: bool = True,
        log: logging.Logger | None = None,
        every: int = 0,
        unit: str = "step",
        transient: bool = False,
    ) -> None:
        self.title, self.total, self.done, self._report = title, total, start, show
        self.log, self.every, self.unit = (log, every, unit) if show else (None, 0, unit)
        self._bar: Any = None
        if show and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as Bar

            count = (DownloadColumn(), TransferSpeedColumn()) if unit == "B" else (MofNCompleteColumn(),)  # bytes
            self._bar = Bar(
                TextColumn("{task.description}"), BarColumn(), *count, TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=transient,
            )
            self._bar.start()
            self._task = self._bar.add_task(title, total=total, completed=start, info="")

    def update(self, done: int, info: str = "") -> None:
        """`done` of the total steps are done; `info` is the latest figures, in a few words."""
        self.done = done
        if self._report:  # rank 0's newest progress, for `hpcdist wait` on the login node
            report_progress(self.title, done, self.total, info, self.unit)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, info=info)
        elif self.log is not None and self.every and (done % self.every == 0 or done == self.total):
            self.log.info("%s %d/%d  %s", self.unit, done, self.total, info)

    def advance(self, info: str = "") -> None:
        """One more step done."""
        self.update(self.done + 1, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class StatusLine:
    """One line that says how a job is doing while someone waits for it.

    On a terminal (stdout): redrawn in place (rich ``Live``) and left on screen at the end.
    Elsewhere (a pipe, a log, CI): a plain line each time the `key` (state, progress) changes,
    at once for an `urgent` change (a new state), else at most every `every_s` seconds, and the
    last line at `close()` if it was not printed yet; elapsed time alone never prints a line.
    """

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._live: Any = None
        self._line, self._key = "", ""
        self._printed_key, self._printed_at = "", float("-inf")
        if sys.stdout.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(markup=False, highlight=False, emoji=False), refresh_per_second=4)
            self._live.start()

    def show(self, line: str, key: str, urgent: bool = False) -> None:
        self._line, self._key = line, key
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(line, no_wrap=True, overflow="ellipsis"))  # one line, cut at the width
        elif key != self._printed_key and (urgent or time.monotonic() - self._printed_at >= self.every_s):
            self._print()

    def _print(self) -> None:
        print(self._line, flush=True)
        self._printed_key, self._printed_at = self._key, time.monotonic()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self._line and self._key != self._printed_key:
            self._print()

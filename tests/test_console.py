"""Tables and progress for people: plain columns without a terminal, log lines in batch logs."""

from __future__ import annotations

import logging

import pytest

from hpcdist.console import Progress, table, text


def test_table_text_is_plain_columns_without_a_terminal() -> None:
    t = table("node", "GB/s", "nodes")
    t.add_row("n1", "12.50", "n[1-2]")
    t.add_row("a-longer-name", "3.00", "[bold]")
    out = text(t)
    assert "\x1b" not in out  # no colour codes when stdout is not a terminal
    lines = out.splitlines()
    assert lines[0].split() == ["node", "GB/s", "nodes"]
    assert lines[1].split() == ["n1", "12.50", "n[1-2]"]  # literal text, not rich markup
    assert lines[2].split() == ["a-longer-name", "3.00", "[bold]"]
    assert all(line == line.rstrip() for line in lines)
    # figures are right-aligned in their column
    assert lines[1].index("12.50") + len("12.50") == lines[2].index("3.00") + len("3.00")


def test_progress_writes_log_lines_every_n_steps_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("hpcdist.test_console")
    with caplog.at_level(logging.INFO, logger=log.name):
        with Progress("train", 7, start=1, log=log, every=3) as bar:
            for step in range(2, 8):
                bar.update(step, f"loss {step:.1f}")
        with Progress("quiet", 3, log=log, every=1, show=False) as bar:  # another rank: silent
            bar.advance("x")
        with Progress("bench", 3, log=log) as bar:  # every=0: nothing in batch logs
            bar.advance("x")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step 3/7  loss 3.0", "step 6/7  loss 6.0", "step 7/7  loss 7.0"]

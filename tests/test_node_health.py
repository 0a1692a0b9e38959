"""The site remembers bad nodes (issue 24): the health record on shared storage, its writers
(the preflight, a job's post-mortem) and its readers (every submit's ``--exclude``, ``hpcdist nodes``)."""

from __future__ import annotations

import json
import multiprocessing
import stat
from pathlib import Path

from hpcdist.store import health

WRITERS, MARKS_EACH = 6, 25


def _write_marks(folder: str, writer: int) -> None:
    for i in range(MARKS_EACH):
        health.mark(Path(folder), f"n{writer}", f"slow link, mark {i}", job_id=str(1000 + writer), source="preflight")


def test_concurrent_marks_from_several_processes_are_all_kept_and_whole(tmp_path: Path) -> None:
    folder = tmp_path / "node-health"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_marks, args=(str(folder), w)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    files = sorted(folder.iterdir())
    assert len(files) == WRITERS * MARKS_EACH  # none lost, no temporary left behind
    for f in files:
        assert json.loads(f.read_text())["source"] == "preflight"  # every file whole
        assert stat.S_IMODE(f.stat().st_mode) == 0o664
    assert stat.S_IMODE(folder.stat().st_mode) == 0o775
    bad = health.bad_nodes(folder, within_s=3600)
    assert [m.node for m in bad] == [f"n{w}" for w in range(WRITERS)]
    assert bad[0].reason == f"slow link, mark {MARKS_EACH - 1}" and bad[0].job_id == "1000"
    assert health.clear(folder, "n0") == MARKS_EACH
    assert "n0" not in [m.node for m in health.bad_nodes(folder, within_s=3600)]

"""What a save reports: the log line ``checkpoint ... committed: X MB in Y s`` (and the SaveStats
the trackers get) counts the whole checkpoint, every rank's shards with the index, not the
index alone; at one rank, the one file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.cli import REPO, run_cli, storage_sets

SCRIPT = REPO / "tests" / "scripts" / "save_sized.py"
STATE_BYTES = 16 * 256 * 256 * 4  # the script's state
FILE_OVERHEAD = 300_000  # HDF5's headers (a 256 KiB metadata block) and the digests, per file
LINE = re.compile(r"checkpoint (\S+) committed: ([\d.]+) MB in ([\d.]+) s \((\d+) MB/s\)")


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_save_logs_the_bytes_of_the_whole_checkpoint(tmp_path: Path, ranks: int) -> None:
    """At 2 ranks steps 1 (plain tensors), 2 (DTensors through dcp.save) and 3 (those in the
    background) are sharded: the logged MB are the index's and both shard files' sizes together."""
    root = tmp_path / "out"
    result = run_cli("submit", "--site", "local", "--set", f"resources.tasks_per_node={ranks}", *storage_sets(root),
                     "--wait", "--", str(SCRIPT), timeout=180)
    assert result.code == 0, result.text
    log = "".join(p.read_text() for p in (root / "logs" / "save_sized").glob("*/*_0_log.err"))
    lines = LINE.findall(log)
    assert [Path(p).name for p, *_ in lines] == [f"step_{s:08d}.h5" for s in (1, 2, 3)], log
    for path, mb, seconds, _ in lines:
        index = Path(path)
        shards = sorted(index.with_suffix(".shards").glob("*.h5"))
        assert len(shards) == (2 if ranks == 2 else 0), shards
        on_disk = index.stat().st_size + sum(p.stat().st_size for p in shards)
        assert float(mb) == round(on_disk / 1e6, 1), (path, mb, on_disk)
        assert STATE_BYTES < on_disk < STATE_BYTES + (1 + len(shards)) * FILE_OVERHEAD, (path, on_disk)
        assert float(seconds) > 0

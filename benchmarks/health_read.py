"""Reading the node-health record with 20,000 files in it, against a plain ``os.listdir`` of the same folder.

Every Slurm ``render`` and ``submit`` reads the record (``hpcdist.store.records.health.bad_nodes``),
so a member who floods its folder must not slow every other member's submit (issue 41, item 7:
20,000 files made each read take 2 s). Three folders of 20,000 entries each, made once:

- ``flood``: files named as marks and dated now (the newest first), each empty, so every one a
  read opens is skipped; a quarter of the entries with names no mark has; one real mark, newest;
- ``old``: 20,000 real marks, all older than the window (a record nobody pruned);
- ``marks``: 20,000 real marks within the window, on 500 nodes.

Each round times, in turn, ``os.listdir`` (the floor), ``bad_nodes`` over the 24-hour window and
the files that read opened (an audit hook on ``open``); the medians over the rounds are printed,
with the read's time over listdir's. The read's one warning goes to a null handler (it is still
made). Run: .venv/bin/python benchmarks/health_read.py [--files 20000] [--rounds 21]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcdist.store.records import health  # noqa: E402

WINDOW_S = 24 * 3600.0


def _mark(folder: Path, node: str, ns: int, tag: int) -> None:
    entry = {"node": node, "reason": "slow", "when": ns / 1e9, "job_id": str(tag), "source": "preflight",
             "user": "x", "host": "h"}
    path = folder / f"{node}.{ns}-1-{tag:08x}.mark.json"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o640)
    os.write(fd, json.dumps(entry).encode())
    os.close(fd)
    os.utime(path, ns=(ns, ns))


def make(kind: str, folder: Path, files: int) -> None:
    folder.mkdir(mode=0o750)
    now = time.time_ns()
    for i in range(files):
        if kind == "flood":
            name = f"n1.{now - i * 1000}-1-{i:08x}.mark.json" if i % 4 else f"junk-{i}"
            os.close(os.open(folder / name, os.O_CREAT | os.O_WRONLY, 0o640))
        elif kind == "old":
            _mark(folder, f"n{i % 500}", now - int((WINDOW_S + 3600 + i) * 1e9), i)
        else:
            _mark(folder, f"n{i % 500}", now - int(i * 1e6), i)
    if kind == "flood":
        _mark(folder, "n2", time.time_ns(), files)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=21)
    args = p.parse_args()
    quiet = logging.getLogger("hpcdist")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    opened: list[str] = []
    sys.addaudithook(lambda event, a: opened.append(str(a[0])) if event == "open" else None)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {os.cpu_count()} CPUs  "
          f"python {platform.python_version()}  {args.files} files per folder, {args.rounds} rounds, "
          f"health.MAX_READ={health.MAX_READ}")
    print(f"{'folder':<8} {'listdir ms':>11} {'read ms':>9} {'read/listdir':>13} {'opened':>7} {'bad nodes':>10}")
    with tempfile.TemporaryDirectory(prefix="health-read-", dir=os.environ.get("HEALTH_READ_DIR")) as tmp:
        for kind in ("flood", "old", "marks"):
            folder = Path(tmp) / kind
            make(kind, folder, args.files)
            listdir_s, read_s, opens, found = [], [], 0, 0
            for _ in range(args.rounds):
                t = time.perf_counter()
                os.listdir(folder)
                listdir_s.append(time.perf_counter() - t)
                opened.clear()
                t = time.perf_counter()
                found = len(health.bad_nodes(folder, WINDOW_S))
                read_s.append(time.perf_counter() - t)
                opens = sum(1 for o in opened if o.startswith(str(folder)))
            ls, rd = statistics.median(listdir_s) * 1e3, statistics.median(read_s) * 1e3
            print(f"{kind:<8} {ls:>11.1f} {rd:>9.1f} {rd / ls:>12.1f}x {opens:>7} {found:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What this disk gives two writers at once, by the way the bytes reach it: the floor under any
checkpoint save (``benchmarks/ckpt_api.py``), measured in the same run.

Two processes each write `--mb` MB (a 2-rank save's share) into their own file and make it durable,
started together; the figure is the slower one's time, the median of --repeat rounds (the order
of the modes alternating):

- ``buffered-random``: ``os.pwrite`` of random float64 in 8 MiB pieces, then ``fdatasync`` (DCP's
  ``FileSystemWriter``: through the page cache, written back at the end);
- ``early-random``: the same, each piece's writeback started at once (``sync_file_range``, no
  wait), as hpcdist's writer does (``hpcdist.store.checkpoint.rawio``);
- ``direct-random``: random bytes through ``O_DIRECT`` (copied into an aligned 8 MiB buffer, then
  written past the page cache), the tail that is not a multiple of 4 KiB buffered, ``fdatasync``;
- ``dd-zeros``: ``dd if=/dev/zero bs=1M conv=fsync`` (``ckpt_api.py``'s ``dd_ranks_s`` ceiling).

    PYTHONPATH=. .venv/bin/python benchmarks/disk_modes.py --dir /var/tmp/hpcdist-bench --mb 378 --repeat 5
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

PIECE = 8 << 20
MODES = ("buffered-random", "early-random", "direct-random", "dd-zeros")


def _buffered(path: Path, src: np.ndarray, early: bool = False) -> None:
    from hpcdist.store.checkpoint.rawio import _SYNC_FILE_RANGE, SYNC_FILE_RANGE_WRITE

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = src.reshape(-1).view(np.uint8).data
    for off in range(0, len(view), PIECE):
        os.pwrite(fd, view[off:off + PIECE], off)
        if early and _SYNC_FILE_RANGE is not None:
            _SYNC_FILE_RANGE(fd, off, PIECE, SYNC_FILE_RANGE_WRITE)
    os.fdatasync(fd)
    os.close(fd)


def _direct(path: Path, src: np.ndarray) -> None:
    view = src.reshape(-1).view(np.uint8).data
    whole = len(view) // 4096 * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    for off in range(0, whole, PIECE):
        n = min(PIECE, whole - off)
        buf[:n] = view[off:off + n]
        os.pwrite(fd, memoryview(buf)[:n], off)
    os.close(fd)
    fd = os.open(path, os.O_WRONLY)
    if whole < len(view):
        os.pwrite(fd, view[whole:], whole)
    os.fdatasync(fd)
    os.close(fd)


def _one(mode: str, path: Path, mb: int, seed: int, start: Any, times: Any) -> None:
    n = mb * 10**6 // 8  # new random bytes for every writer and round: nothing the disk saw before
    src = np.random.default_rng(seed).random(n)
    start.wait()
    t0 = time.perf_counter()
    if mode == "dd-zeros":
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb * 10**6 >> 20}", "conv=fsync"],
                       capture_output=True, check=True)
    elif mode == "direct-random":
        _direct(path, src)
    else:
        _buffered(path, src, early=mode == "early-random")
    times.append(time.perf_counter() - t0)
    start.wait()
    path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/hpcdist-bench")
    parser.add_argument("--mb", type=int, default=378, help="MB per writer")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    got: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeat):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            with mp.Manager() as manager:
                start, times = manager.Barrier(2), manager.list()
                procs = [mp.Process(target=_one, args=(mode, folder / f"disk-modes-{i}.bin", args.mb,
                                                                 time.time_ns() + i, start, times))
                         for i in range(2)]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                got[mode].append(max(times))
    load = os.getloadavg()[0]
    print(f"# 2 writers x {args.mb} MB, medians of {args.repeat}, load average {load:.2f}")
    for mode in MODES:
        print(f"{mode:16s} {statistics.median(got[mode]):.3f} s  (rounds: {', '.join(f'{t:.2f}' for t in got[mode])})")


if __name__ == "__main__":
    main()

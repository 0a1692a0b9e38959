"""Run a function on N forked ranks in a gloo group (benchmarks only; jobs use the real launcher)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def _worker(fn: Callable[..., Any], rank: int, world: int, init: str, threads: int, q: Any, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        q.put((rank, pickle.dumps(fn(rank, world, *args)), None))
    except BaseException:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, threads: int = 1) -> list[Any]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(fn, r, world, f"file://{tmp}/s", threads, q, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        for _ in range(world):
            rank, value, err = q.get(timeout=900)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join()
    return [out[r] for r in range(world)]

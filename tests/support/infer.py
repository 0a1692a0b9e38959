"""Fixtures and helpers for the inference tests: tiny checkpoints in the shared format, and
real gloo process groups in forked processes (tensor parallelism needs several ranks)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcdist.model.checkpoint import write_checkpoint
from hpcdist.model.gpt import GPT, GPTConfig

TINY = GPTConfig(vocab_size=257, context=64, n_layer=2, n_head=4, d_model=32)


def make_model(cfg: GPTConfig, seed: int = 0, scale: float = 1.0) -> GPT:
    """A seeded GPT; `scale` > 1 spreads the logits so greedy choices are far from ties."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
    return model


def make_checkpoint(directory: Path, cfg: GPTConfig = TINY, seed: int = 0, scale: float = 1.0,
                    step: int = 3) -> tuple[Path, GPT]:
    model = make_model(cfg, seed, scale)
    return write_checkpoint(directory, step, model.state_dict(), cfg), model


def _worker(fn: Callable[..., Any], rank: int, world: int, init: str, queue: Any, args: tuple[Any, ...],
            group_timeout_s: float = 60) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=group_timeout_s))
        # plain pickle: the data travels in the message (torch's queue reducer would pass
        # shared-memory handles that vanish when this process exits)
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120,
              group_timeout_s: float = 60) -> list[Any]:
    """`fn(rank, world, *args)` on `world` forked ranks joined in a gloo group (collectives time
    out after `group_timeout_s`); their results in rank order."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [ctx.Process(target=_worker, args=(fn, r, world, init, queue, args, group_timeout_s))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            for _ in range(world):
                rank, status, value = queue.get(timeout=timeout)
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                results[rank] = pickle.loads(value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]


def _save_fsdp(rank: int, world: int, directory: str, cfg: GPTConfig, seed: int, step: int) -> None:
    """`make_model(cfg, seed)` sharded by FSDP2 over `world` ranks (every block, then the root, as
    train_gpt does) and saved as train_gpt saves it: model and optimizer, every rank its own shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpcdist.model.checkpoint import model_attrs
    from hpcdist.store.sharded import checkpoint as sharded
    from hpcdist.train.parallel import checkpoint_state

    model = make_model(cfg, seed)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    sharded.save(Path(directory), step, checkpoint_state(model, opt, cfg.tied), attrs=model_attrs(cfg))


def make_sharded_checkpoint(directory: Path, cfg: GPTConfig = TINY, seed: int = 0, step: int = 3,
                            world: int = 2) -> tuple[Path, GPT]:
    """A sharded checkpoint of `make_model(cfg, seed)` as FSDP2 at `world` ranks writes it: (its index, the model)."""
    run_ranks(world, _save_fsdp, str(directory), cfg, seed, step)
    return directory / f"step_{step:08d}.h5", make_model(cfg, seed)

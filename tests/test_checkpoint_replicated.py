"""The README's ``ctx.checkpoints.save(step, state)`` and ``load_latest()`` at 2 ranks: a DDP model and
its optimizer are taken to be the same on every rank (DCP's rule), written once across the ranks,
checked across them first, and read back once per node into copies each rank may write."""

from __future__ import annotations

import errno
import logging
import types
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpcdist.errors import CheckpointError
from hpcdist.store.sharded import checkpoint as sharded
from hpcdist.store.sharded import node_read
from tests.support.rankctx import rank_context
from tests.test_sharded_checkpoint import _quiet, equal, leave, spawn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def ddp_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same start on every rank, as DDP keeps it
    m = torch.nn.Sequential(torch.nn.Linear(512, 600), torch.nn.ReLU(), torch.nn.Linear(600, 8))  # 1.2 MB weight
    if dist.is_initialized():
        m = torch.nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    torch.manual_seed(1)
    m(torch.randn(4, 512)).sum().backward()
    opt.step()
    return m, opt


def context(rank: int, world: int, port: int, root: Path) -> Any:
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return rank_context(root, rank=rank, world=world, timeout_s=60, io_timeout_s=60, keep_last=None)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def readme_round_trip(rank: int, world: int, port: int, root: Path) -> None:
    """What the README writes, then the cases around it; each rank's findings to ``r<rank>.pt``."""
    _quiet()
    ctx = context(rank, world, port, root)
    lines = Lines()
    ctx.log.addHandler(lines)
    out: dict[str, Any] = {}
    m, opt = ddp_model_and_optimizer()
    ctx.checkpoints.save(1, {"model": m.state_dict(), "opt": opt.state_dict()})  # as the README writes it
    step, state = ctx.checkpoints.load_latest() or (0, None)
    fresh, fresh_opt = ddp_model_and_optimizer()
    fresh_opt.load_state_dict(state["opt"])  # int keys, as opt.state_dict() has them
    fresh.load_state_dict(state["model"])
    out["step"] = step
    out["model"] = equal({k: v.clone() for k, v in m.state_dict().items()}, fresh.state_dict())
    out["opt"] = equal(opt.state_dict()["state"], fresh_opt.state_dict()["state"])
    stats = ctx.checkpoints.loaded[-1]
    out["stats"] = (stats.bytes, stats.bytes_read, stats.node_ranks, stats.fallback)
    weight = state["model"]["module.0.weight"]
    if rank == 0:
        weight.add_(1.0)  # this rank's copy only
    dist.barrier()
    out["own_copy"] = torch.equal(weight, m.state_dict()["module.0.weight"] + (1.0 if rank == 0 else 0.0))

    # values that differ between the ranks: each rank's RNG-like tensor, and one byte of a large one
    torch.manual_seed(100 + rank)
    big = torch.zeros(100_000)
    big[12_345] = float(rank)  # outside the sampled windows: only the full comparison sees it
    del lines.lines[:]
    ctx.checkpoints.save(2, {"model": m.state_dict(), "noise": torch.randn(50_000), "pos": rank, "big": big})
    out["sampled_warnings"] = list(lines.lines)
    _, state = ctx.checkpoints.load_latest() or (0, {})
    torch.manual_seed(100)
    out["noise_is_rank_0s"] = torch.equal(state["noise"], torch.randn(50_000)) and state["pos"] == 0
    del lines.lines[:]
    ctx.log.setLevel(logging.DEBUG)
    ctx.checkpoints.save(3, {"model": m.state_dict(), "big": big})
    ctx.log.setLevel(logging.INFO)
    out["full_warnings"] = list(lines.lines)
    ctx.checkpoints.save(4, {"model": m.state_dict()}, replicated=False)

    # files that cannot be mapped (as on some FUSE mounts): every rank reads what it holds, and says why
    ctx.checkpoints.save(5, {"model": m.state_dict(), "opt": opt.state_dict()})

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENODEV, "No such device")

    kept = node_read.mmap
    node_read.mmap = types.SimpleNamespace(**{k: getattr(kept, k) for k in dir(kept) if k.isupper()}, mmap=refuse)
    _, state = ctx.checkpoints.load_latest() or (0, {})
    node_read.mmap = kept
    stats = ctx.checkpoints.loaded[-1]
    out["alone"] = (stats.bytes, stats.bytes_read, stats.node_ranks, stats.fallback,
                    equal(opt.state_dict()["state"], state["opt"]["state"]))

    # a save that fails on one rank (rank 1's own value cannot be written): every rank raises its
    # error, none waits, and nothing of the save is committed
    try:
        ctx.checkpoints.save(6, {"model": m.state_dict()}, per_rank={"note": object() if rank else "fine"})
        out["failed_save"] = ""
    except CheckpointError as exc:
        out["failed_save"] = str(exc)
    out["after_failed_save"] = sorted(p.name for p in ctx.checkpoints.directory.glob("step_*.h5"))

    # a flipped byte in a tensor that is read once per node: the same error on every rank
    index = ctx.checkpoints.store.path(5)
    if rank == 0:
        md = sharded.ShardedReader(index).read_metadata()
        chunk = next(c for i, c in md.storage_data.items() if i.fqn == "model.module.0.weight")
        with open(sharded.shards_dir(index.parent, 5) / chunk.file, "r+b") as f:
            f.seek(chunk.offset + 100)
            byte = f.read(1)
            f.seek(chunk.offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        ctx.checkpoints.load_latest()
        out["flipped"] = ""
    except CheckpointError as exc:
        out["flipped"] = str(exc)
    torch.save(out, root / f"r{rank}.pt")
    leave(ctx)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("readme")
    spawn(readme_round_trip, 2, root)
    return root, [torch.load(root / f"r{rank}.pt") for rank in (0, 1)]


def stored_bytes(root: Path, step: int) -> int:
    """The bytes of every chunk of step `step`: its tensors and its values."""
    md = sharded.ShardedReader(root / "ckpt" / f"step_{step:08d}.h5").read_metadata()
    return sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize for c in md.storage_data.values())


def test_the_readme_save_at_2_ranks_writes_each_tensor_once_spread_over_the_ranks(
        ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = ranks
    md = sharded.ShardedReader(root / "ckpt" / "step_00000001.h5").read_metadata()
    writers: dict[str, list[int]] = {}
    for i, c in md.storage_data.items():
        writers.setdefault(i.fqn, []).append(c.rank)
    tensors = [f for f in writers if f.startswith(("model.", "opt.state."))]
    assert "model.module.0.weight" in tensors and "opt.state.0.exp_avg" in tensors
    assert all(len(writers[f]) == 1 for f in tensors)  # once each
    assert {writers[f][0] for f in tensors} == {0, 1}  # the writing spread over both ranks
    with h5py.File(root / "ckpt" / "step_00000004.h5") as f:  # replicated=False: rank 0's state in one file
        assert "layout" not in f.attrs and "state" in f


def test_load_latest_reads_each_byte_once_per_node_and_gives_each_rank_its_own_copy(
        ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, out = ranks
    total = stored_bytes(root, 1)
    for got in out:
        assert got["step"] == 1 and got["model"] == [] and got["opt"] == []  # model and AdamW state bit for bit
        assert got["own_copy"]  # rank 0 wrote into its tensor; rank 1's stayed as loaded
        size, read, node_ranks, fallback = got["stats"]
        assert size == total and node_ranks == 2 and fallback == ""
        assert read < 0.8 * total  # its share of the large tensors, and the small ones
    small = total - 3 * 512 * 600 * 4  # the large weight and its two moments are read by one rank each
    assert total <= out[0]["stats"][1] + out[1]["stats"][1] <= total + small


def test_values_that_differ_between_ranks_are_saved_as_rank_0_holds_them_and_named(
        ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, out = ranks
    warned = [line for line in out[0]["sampled_warnings"] if "not the same on every rank" in line]
    assert len(warned) == 1 and "noise, pos" in warned[0] and "per_rank=" in warned[0]
    assert "big" not in warned[0]  # one byte of 400 kB outside the sampled windows: not seen by default
    assert out[1]["sampled_warnings"] == []  # rank 0 wrote them, rank 0 says so
    assert all(got["noise_is_rank_0s"] for got in out)
    full = [line for line in out[0]["full_warnings"] if "not the same on every rank" in line]
    assert len(full) == 1 and ": big;" in full[0]  # the log at DEBUG compares every byte


def test_where_files_cannot_be_mapped_every_rank_reads_everything_itself_and_says_why(
        ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, out = ranks
    for got in out:
        size, read, node_ranks, fallback, differs = got["alone"]
        assert size == read == stored_bytes(root, 5) and node_ranks == 1 and differs == []
        assert fallback.startswith(f"rank 0 cannot map {root / 'ckpt'}") and "No such device" in fallback


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_with_its_error_and_commits_nothing(
        ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, out = ranks
    assert out[0]["failed_save"] == out[1]["failed_save"] != ""  # rank 1's error, on both
    assert "note" in out[0]["failed_save"] and "object" in out[0]["failed_save"]
    assert out[0]["after_failed_save"][-1] == "step_00000005.h5"  # step 6 was never committed


def test_a_flipped_byte_in_a_shared_tensor_fails_load_latest_on_every_rank_alike(
        ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, out = ranks
    assert out[0]["flipped"] == out[1]["flipped"] != ""
    assert "model.module.0.weight" in out[0]["flipped"] and "does not match its xxh3-128 checksum" in out[0]["flipped"]
    assert "\n" not in out[0]["flipped"]


def test_an_optimizer_state_keeps_its_int_keys_and_empty_state_through_a_sharded_checkpoint(tmp_path: Path) -> None:
    m, opt = ddp_model_and_optimizer()
    unused = torch.optim.SGD(m.parameters(), lr=0.1)
    ctx = rank_context(tmp_path)
    ctx.checkpoints.save(1, {"opt": opt.state_dict(), "unused": unused.state_dict()}, sharded=True)
    _, state = ctx.checkpoints.load_latest() or (0, {})
    assert sorted(state["opt"]["state"]) == [0, 1, 2, 3] and state["unused"]["state"] == {}
    again = torch.optim.AdamW(m.parameters(), lr=0.5)
    again.load_state_dict(state["opt"])
    torch.optim.SGD(m.parameters(), lr=0.5).load_state_dict(state["unused"])
    assert equal(opt.state_dict(), again.state_dict()) == []
    ctx.close()

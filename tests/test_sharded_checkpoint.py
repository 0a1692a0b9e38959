"""Sharded checkpoints (``hpcdist.store.sharded.checkpoint``, ``ctx.checkpoints`` with DTensors): FSDP2 on CPU
with gloo, real processes, real HDF5 files. Saved at 2 ranks, loaded at 4 ranks and in one
process bit for bit; a rank killed mid-save; a flipped byte; DCP's own format in and out."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hpcdist.api.context import Context
from hpcdist.errors import CheckpointError
from hpcdist.runtime import teardown
from hpcdist.store import CheckpointStore
from hpcdist.store.sharded import checkpoint as sharded
from tests.support.rankctx import rank_context

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same start on every rank; 30 rows: uneven shards at 4 ranks
    return torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.ReLU(), torch.nn.Linear(30, 8))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def context(rank: int, world: int, port: int, root: Path) -> Context:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    return rank_context(root, rank=rank, world=world, timeout_s=60, io_timeout_s=60)


def sharded_model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = model()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=0.01)


def full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor of model and optimizer whole (gathered), keyed by parameter name."""
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def half_of(position: int) -> torch.Tensor:
    """A bfloat16 tensor whose values depend on `position` (30 rows: uneven shards at 4 ranks)."""
    return (torch.arange(120, dtype=torch.float32).reshape(30, 4) / 7 + position).to(torch.bfloat16)


def state_of(m: torch.nn.Module, opt: torch.optim.Optimizer, position: int) -> dict[str, Any]:
    msd, osd = get_state_dict(m, opt)  # optimizer state keyed by parameter name: it reshards
    replicated = {f"t{i}": torch.full((64 * (i + 1),), float(position + i)) for i in range(4)}  # same on all ranks
    half = half_of(position)  # sharded like the parameters: bf16 chunks resharded on load
    if isinstance(m[0].weight, DTensor):
        half = distribute_tensor(half, m[0].weight.device_mesh, [Shard(0)])
    return {"model": msd, "optim": osd, "sampler": {"position": position}, "replicated": replicated, "half": half}


def leave(ctx: Context | None = None) -> None:
    """End a rank as a job's rank ends: the context closed, then ``teardown.leave`` (a barrier on
    every group, so no gloo worker frees a collective's tensors while the interpreter finalizes,
    which aborted ranks with SIGABRT)."""
    if ctx is not None:
        ctx.close()
    teardown.leave()


def _quiet() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # 2-4 ranks on a few cores


def train_and_save(rank: int, world: int, port: int, root: Path) -> None:
    """3 AdamW steps at `world` ranks; steps 2 and 3 saved in the background (the second into the
    first one's host buffers), step 3 committed by `close`."""
    _quiet()
    ctx = context(rank, world, port, root)
    m, opt = sharded_model(world)
    torch.manual_seed(100 + rank)
    for step in (1, 2, 3):
        m(torch.randn(4, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        whole = full(m, opt)
        if rank == 0:
            torch.save(whole, root / f"ref{step}.pt")
        if step >= 2:
            ctx.checkpoints.save(step, state_of(m, opt, 100 * step), background=True)
    leave(ctx)


def load_and_gather(rank: int, world: int, port: int, root: Path) -> None:
    _quiet()
    ctx = context(rank, world, port, root)
    torch.manual_seed(7)
    m, opt = sharded_model(world)
    for p in m.parameters():  # nothing of the saved values by chance
        torch.nn.init.normal_(p)
    state = state_of(m, opt, 0)
    loaded = ctx.checkpoints.load_latest(into=state)
    assert loaded is not None and loaded[0] == 3
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    whole = full(m, opt)
    if rank == 0:
        torch.save({"whole": whole, "position": state["sampler"]["position"]}, root / f"got{world}.pt")
    half = state["half"].full_tensor()  # a collective: every rank
    if rank == 0:
        torch.save(half, root / f"half{world}.pt")
    leave(ctx)


def load_flipped(rank: int, world: int, port: int, root: Path) -> None:
    _quiet()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    m, opt = sharded_model(world)
    state = state_of(m, opt, 0)
    skipped: list[str] = []
    step = sharded.load_latest(root / "ckpt", state, report=skipped.append)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    whole = full(m, opt)
    torch.save({"step": step, "skipped": skipped, "whole": whole, "replicated": state["replicated"]},
               root / f"flipped{rank}.pt")
    leave()


class DieAfterWrite(sharded.ShardedWriter):
    """A writer whose rank `victim` is SIGKILLed once its own shard is durable, before the commit."""

    victim = 0

    def write_data(self, plan: Any, planner: Any) -> Any:
        done = super().write_data(plan, planner)
        if dist.get_rank() == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return done


def save_then_die(rank: int, world: int, port: int, root: Path, victim: int) -> None:
    _quiet()
    ctx = context(rank, world, port, root)
    m, opt = sharded_model(world)
    ctx.checkpoints.save(1, state_of(m, opt, 1))
    if rank == 0:
        torch.save(full(m, opt), root / "ref1.pt")
    else:
        full(m, opt)
    for p in m.parameters():
        p.data.add_(1.0)
    writer = DieAfterWrite(ctx.checkpoints.directory, 2)
    writer.victim = victim
    sharded.save_with(state_of(m, opt, 2), writer, ctx.checkpoints._io_group)


def spawn(fn: Any, world: int, *args: Any) -> None:
    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True, start_method="spawn")


def equal(a: Any, b: Any, where: str = "") -> list[str]:
    """Paths where the nested values `a` and `b` differ (tensors bit for bit)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in equal(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in equal(x, y, f"{where}/{i}")]
    if isinstance(a, torch.Tensor):
        bits = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
        return [] if same else [where]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def one_process_load(directory: Path, report: Any = None) -> tuple[int | None, dict[str, Any], int]:
    """Load into a plain model and optimizer in this process; (step, whole state, sampler position)."""
    m, opt = sharded_model(1)
    state = state_of(m, opt, 0)
    step = sharded.load_latest(directory, state, report=report)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step, full(m, opt), state["sampler"]["position"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    spawn(train_and_save, 2, root)
    return root


def test_fsdp_state_saved_at_2_ranks_loads_bit_identical_at_4_ranks(saved: Path) -> None:
    spawn(load_and_gather, 4, saved)
    got = torch.load(saved / "got4.pt")
    ref = torch.load(saved / "ref3.pt")
    assert equal(ref, got["whole"]) == []
    assert got["position"] == 300
    assert equal(half_of(300), torch.load(saved / "half4.pt")) == []  # bf16 resharded 2 -> 4, bit for bit
    assert ref["optim"]["state"]["0.weight"]["exp_avg"].abs().sum() > 0  # the optimizer state is real
    files = sorted(p.name.split("-")[0] for p in sharded.shards_dir(saved / "ckpt", 3).iterdir())
    assert files == ["r00000", "r00001"]  # one file per saving rank
    md = sharded.ShardedReader(saved / "ckpt" / "step_00000003.h5").read_metadata()
    writers = [i.fqn for i in md.storage_data if i.fqn.startswith("replicated.")]
    assert sorted(writers) == [f"replicated.t{i}" for i in range(4)]  # each replicated tensor written once


def test_fsdp_state_loads_bit_identical_in_one_process(saved: Path) -> None:
    step, whole, position = one_process_load(saved / "ckpt")
    assert (step, position) == (3, 300)
    assert equal(torch.load(saved / "ref3.pt"), whole) == []


def _dumped(path: Path, dataset: str) -> tuple[str, str]:
    """(type, torch_dtype) of a dataset as h5py reads it, and as h5dump shows it where it is installed."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        seen = (ds.dtype.str, str(ds.attrs["torch_dtype"]))
    if shutil.which("h5dump"):
        out = subprocess.run(["h5dump", "-H", "-A", "-d", dataset, str(path)], capture_output=True, text=True,
                             check=True).stdout
        assert "DATATYPE  H5T_STD_U16LE" in out and 'ATTRIBUTE "torch_dtype"' in out and '"bfloat16"' in out, out
    return seen


def test_bf16_chunks_are_stored_as_a_whole_checkpoint_stores_bf16_and_read_back_bit_identical(
        saved: Path, tmp_path: Path) -> None:
    """The store's one encoding of a dtype NumPy lacks (``hpcdist.store.checkpoint.tree``): the bits as 16-bit
    unsigned integers named by the attribute ``torch_dtype``, in each rank's shard as in a whole checkpoint."""
    index = saved / "ckpt" / "step_00000003.h5"
    chunks = [c for i, c in sharded.ShardedReader(index).read_metadata().storage_data.items() if i.fqn == "half"]
    assert sorted((c.rank, c.shape) for c in chunks) == [(0, (15, 4)), (1, (15, 4))]
    whole = CheckpointStore(tmp_path).save(1, {"half": half_of(300)}).path
    assert _dumped(whole, "/half") == ("<u2", "bfloat16")
    for c in chunks:
        assert _dumped(sharded.shards_dir(saved / "ckpt", 3) / c.file, c.dataset) == ("<u2", "bfloat16")
    assert equal(half_of(300), sharded.read_full(index, keys=["half"])["half"]) == []


def test_a_flipped_byte_is_named_and_the_previous_step_is_used(saved: Path, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", directory)
    md = sharded.ShardedReader(directory / "step_00000003.h5").read_metadata()
    fqn, chunk = next((i.fqn, c) for i, c in md.storage_data.items()
                      if c.rank == 1 and c.torch_dtype and c.offset >= 0 and "exp_avg" in i.fqn)
    path = sharded.shards_dir(directory, 3) / chunk.file
    with open(path, "r+b") as f:
        f.seek(chunk.offset + 5)
        byte = f.read(1)
        f.seek(chunk.offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    skipped: list[str] = []
    step, whole, position = one_process_load(directory, skipped.append)
    assert (step, position) == (2, 200)
    assert equal(torch.load(saved / "ref2.pt"), whole) == []
    assert len(skipped) == 1
    assert str(path) in skipped[0] and f"tensor {fqn} " in skipped[0] and "written by rank 1" in skipped[0]


def test_a_flipped_byte_in_a_replicated_tensor_fails_every_rank_that_reads_it(saved: Path, tmp_path: Path) -> None:
    """At 2 ranks both read the replicated tensors and each checks what it read itself: both find the
    mismatch and load the previous step."""
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    md = sharded.ShardedReader(tmp_path / "ckpt" / "step_00000003.h5").read_metadata()
    chunk = next(c for i, c in md.storage_data.items() if i.fqn == "replicated.t3")
    path = sharded.shards_dir(tmp_path / "ckpt", 3) / chunk.file
    with open(path, "r+b") as f:
        f.seek(chunk.offset)
        byte = f.read(1)
        f.seek(chunk.offset)
        f.write(bytes([byte[0] ^ 0x01]))
    spawn(load_flipped, 2, tmp_path)
    ref = torch.load(saved / "ref2.pt")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"flipped{rank}.pt")
        assert got["step"] == 2 and (rank or equal(ref, got["whole"]) == [])  # gathered on rank 0
        assert torch.equal(got["replicated"]["t3"], torch.full((256,), 203.0))
        assert len(got["skipped"]) == 1 and str(path) in got["skipped"][0] and "replicated.t3" in got["skipped"][0]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_save_leaves_the_previous_commit_latest(tmp_path: Path, victim: int) -> None:
    with pytest.raises(mp.ProcessExitedException):
        spawn(save_then_die, 2, tmp_path, victim)
    directory = tmp_path / "ckpt"
    store = CheckpointStore(directory)
    assert store.steps() == [1] and store.latest() == directory / "step_00000001.h5"
    assert any(sharded.shards_dir(directory, 2).iterdir())  # a shard was written, never committed
    step, whole, position = one_process_load(directory)
    assert (step, position) == (1, 1)
    assert equal(torch.load(tmp_path / "ref1.pt"), whole) == []


def test_retention_removes_shard_folders_and_load_latest_without_into_gives_the_whole_state(tmp_path: Path) -> None:
    from hpcdist.api.checkpoints import Checkpoints

    ctx = context(0, 1, 0, tmp_path)
    ckpts: Checkpoints = ctx.checkpoints  # keep_last=3
    left = ckpts.directory / ".purge-step_00000000.shards-0dead000"  # a killed process's deletion
    (left / "r00000-x.h5").parent.mkdir(parents=True)
    (left / "r00000-x.h5").write_bytes(b"x" * 1000)
    for step in range(1, 6):
        ckpts.save(step, {"w": torch.full((8,), float(step)), "pos": step}, sharded=True)
    assert ckpts.store.steps() == [3, 4, 5]
    assert sorted(p.name for p in ckpts.directory.glob("*.shards")) == [
        "step_00000003.shards", "step_00000004.shards", "step_00000005.shards"]
    sharded.purge_wait()  # the pruned folders' bytes are deleted in the background
    assert list(ckpts.directory.glob(".purge-*")) == []
    loaded = ckpts.load_latest()
    assert loaded is not None and loaded[0] == 5 and loaded[1]["pos"] == 5
    assert torch.equal(loaded[1]["w"], torch.full((8,), 5.0))
    into = {"w": torch.zeros(8), "pos": 0}
    assert ckpts.load_latest(into=into) == (5, into) and into["pos"] == 5
    (ckpts.directory / "step_00000006.shards").write_text("in the way")  # the write of step 6 fails
    ckpts.save(6, {"w": torch.zeros(8), "pos": 6}, sharded=True, background=True)  # returns once copied
    with pytest.raises(CheckpointError, match="rank 0 writing its shard .*step_00000006.shards"):
        ckpts.wait()  # the background save's error, once
    ckpts.wait()
    assert ckpts.store.steps() == [3, 4, 5]
    (ckpts.directory / "step_00000006.shards").unlink()
    ckpts.save(6, {"w": torch.zeros(8)})  # unsharded: never skipped for an older sharded step
    with pytest.raises(CheckpointError, match="step_00000006.h5 was saved unsharded"):
        ckpts.load_latest(into=into)
    ctx.close()


def test_a_set_aside_sharded_run_stays_whole_and_loadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A new run (job 42, saving without loading) in the directory of job 41's sharded run: the
    earlier run's index files move to previous/run-<id>/ with their shard folders, and stay there
    whole after the new run wrote and pruned steps of the same numbers: `hpcdist ckpt export-dcp`
    reads them."""
    from tests.support.hf import cli

    first = rank_context(tmp_path, job_id="41", timeout_s=60)
    for step in (1, 2, 3):
        first.checkpoints.save(step, {"w": torch.full((8,), float(step)), "pos": step}, sharded=True)
    old = first.checkpoints.store.run_id
    first.close()
    second = rank_context(tmp_path, job_id="42", timeout_s=60, keep_last=1)
    for step in (1, 2, 3):
        second.checkpoints.save(step, {"w": torch.full((8,), -float(step)), "pos": -step}, sharded=True)
    second.close()
    sharded.purge_wait()
    moved = tmp_path / "ckpt" / "previous" / f"run-{old}"
    assert sorted(p.name for p in moved.glob("step_*")) == [
        "step_00000001.h5", "step_00000001.shards", "step_00000002.h5", "step_00000002.shards",
        "step_00000003.h5", "step_00000003.shards"]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000003.h5", "step_00000003.shards"]
    code, _, err = cli(capsys, "ckpt", "export-dcp", str(moved / "step_00000002.h5"), str(tmp_path / "dcp"))
    assert code == 0, err
    back: dict[str, Any] = {"w": torch.zeros(8), "pos": 0}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
    assert torch.equal(back["w"], torch.full((8,), 2.0)) and back["pos"] == 2


def test_dcp_loads_ours_and_a_dcp_folder_imports_and_exports(saved: Path, tmp_path: Path) -> None:
    index = saved / "ckpt" / "step_00000003.h5"
    m, opt = sharded_model(1)
    state = state_of(m, opt, 0)
    dcp.load(state, storage_reader=sharded.ShardedReader(index))  # DCP's own call, our storage
    assert state["sampler"]["position"] == 300
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert equal(torch.load(saved / "ref3.pt"), full(m, opt)) == []

    sharded.export_dcp(index, tmp_path / "dcp")  # out to DCP's format and back in through an import
    sharded.import_dcp(tmp_path / "dcp", tmp_path / "ours", 3)
    m2, opt2 = sharded_model(1)
    back = state_of(m2, opt2, 0)
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
    assert equal(state, back) == []
    again = sharded.read_full(tmp_path / "ours" / "step_00000003.h5")
    assert equal(sharded.read_full(index), again) == []


def test_import_dcp_claims_the_directory_and_sets_aside_what_is_there(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`hpcdist ckpt import-dcp -o DIR` is a writer like any run: refused while a live run holds
    DIR; else it commits as a new run, the checkpoints already there moved to previous/ (a resume
    then reads the import, with its own run id, never mixing it with the earlier run's steps)."""
    import time

    from hpcdist.store.checkpoint import directory as layout
    from hpcdist.store.checkpoint.claim import Claim, Holder
    from tests.support.hf import cli

    mine = {"w": torch.arange(6.0)}
    dcp.save(mine, storage_writer=dcp.FileSystemWriter(str(tmp_path / "theirs")), no_dist=True)
    ours = tmp_path / "ours"
    earlier = CheckpointStore(ours, job_id="41")
    for step in (8, 9):
        earlier.save(step, {"w": torch.zeros(2)})
    live = Claim(ours, Holder("local-1", socket.gethostname(), 1, time.time())).acquire()  # pid 1 lives
    code, _, err = cli(capsys, "ckpt", "import-dcp", str(tmp_path / "theirs"), "-o", str(ours), "--step", "5")
    assert code != 0 and f"checkpoint directory {ours} is claimed by job local-1" in err and err.count("\n") == 1
    assert CheckpointStore(ours).steps() == [8, 9] and layout.read_commit(ours).run == earlier.run_id
    live.release()

    code, out, err = cli(capsys, "ckpt", "import-dcp", str(tmp_path / "theirs"), "-o", str(ours), "--step", "5")
    assert code == 0, err
    moved = ours / "previous" / f"run-{earlier.run_id}"
    said = f"moved the 2 checkpoint(s) already there (steps 8, 9, run {earlier.run_id}) and their latest to {moved}"
    assert said in out, out
    commit = layout.read_commit(ours)
    assert commit.path == ours / "step_00000005.h5" and commit.run not in ("", earlier.run_id)
    assert CheckpointStore(ours).steps() == [5] and sorted(p.name for p in moved.glob("step_*.h5")) == [
        "step_00000008.h5", "step_00000009.h5"]
    assert equal(mine, sharded.read_full(ours / "step_00000005.h5")) == []
    assert not (ours / ".claim").exists()


def test_ckpt_commands_export_to_dcp_and_import_from_a_dcp_save_folder(saved: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`hpcdist ckpt export-dcp` (a checkpoint directory's latest) gives a folder `dcp.load` reads, equal to
    what was saved; `hpcdist ckpt import-dcp` commits a `dcp.save` folder as a sharded step."""
    from tests.support.hf import cli

    code, out, err = cli(capsys, "ckpt", "export-dcp", str(saved / "ckpt"), str(tmp_path / "dcp"))
    assert code == 0, err
    assert f"of {saved / 'ckpt' / 'step_00000003.h5'}" in out
    m, opt = sharded_model(1)
    state = state_of(m, opt, 0)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert equal(torch.load(saved / "ref3.pt"), full(m, opt)) == [] and state["sampler"]["position"] == 300

    mine = {"w": torch.arange(12.0).reshape(3, 4), "nested": {"b": torch.ones(5, dtype=torch.bfloat16)}, "n": 7}
    dcp.save(mine, storage_writer=dcp.FileSystemWriter(str(tmp_path / "theirs")), no_dist=True)
    code, out, err = cli(capsys, "ckpt", "import-dcp", str(tmp_path / "theirs"), "-o", str(tmp_path / "ours"),
                         "--step", "5")
    assert code == 0, err
    assert CheckpointStore(tmp_path / "ours").steps() == [5]
    assert equal(mine, sharded.read_full(tmp_path / "ours" / "step_00000005.h5")) == []
    code, _, err = cli(capsys, "ckpt", "import-dcp", str(tmp_path), "-o", str(tmp_path / "ours"))
    assert code != 0 and f"{tmp_path} is not a dcp.save folder (it has no .metadata)" in err
    assert err.count("\n") == 1


def save_and_load_replicated(rank: int, world: int, port: int, root: Path) -> None:
    """DDP's state, declared replicated, with per-rank values, through ``ctx.checkpoints``."""
    _quiet()
    ctx = context(rank, world, port, root)
    torch.manual_seed(0)
    model = {f"w{i}": torch.randn(64, 32) for i in range(6)}  # the same on every rank
    ctx.checkpoints.save(5, {"model": model, "step": 5}, replicated=True, background=True,
                         per_rank={"rng": torch.full((3,), float(rank)), "pos": 10 * rank})
    staged = ctx.checkpoints._stager._cache  # the host copy this rank made: only what it writes
    copied = sum(t.nbytes for t in staged.get("model", {}).values())
    ctx.checkpoints.wait()
    into = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "step": 0, "rng": torch.zeros(3), "pos": -1}
    loaded = ctx.checkpoints.load_latest(into=into)
    whole = ctx.checkpoints.load_latest()
    torch.save({"loaded": loaded, "whole": whole, "model": model, "copied": copied}, root / f"replicated{rank}.pt")
    leave(ctx)


def test_a_state_declared_replicated_is_written_and_staged_once_across_ranks_and_per_rank_values_stay_per_rank(
        tmp_path: Path) -> None:
    spawn(save_and_load_replicated, 2, tmp_path)
    md = sharded.ShardedReader(tmp_path / "ckpt" / "step_00000005.h5").read_metadata()
    writers = {i.fqn: c.rank for i, c in md.storage_data.items()}
    assert sorted(k for k in writers if k.startswith("model.")) == [f"model.w{i}" for i in range(6)]  # once each
    assert set(writers[f"model.w{i}"] for i in range(6)) == {0, 1}  # the writing spread over both ranks
    assert writers["__per_rank__.r00000.rng"] == 0 and writers["__per_rank__.r00001.rng"] == 1
    got = [torch.load(tmp_path / f"replicated{rank}.pt") for rank in (0, 1)]
    total = sum(t.nbytes for t in got[0]["model"].values())
    assert got[0]["copied"] + got[1]["copied"] == total and 0 < got[0]["copied"] < total  # the copy split too
    for rank in (0, 1):
        got = torch.load(tmp_path / f"replicated{rank}.pt")
        for step, state in (got["loaded"], got["whole"]):
            assert step == 5 and state["step"] == 5 and state["pos"] == 10 * rank
            assert torch.equal(state["rng"], torch.full((3,), float(rank)))
            assert equal(got["model"], state["model"]) == []

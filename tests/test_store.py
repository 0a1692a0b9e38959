"""The model-agnostic checkpoint API (`hpcdist.store.CheckpointStore`) on real HDF5 files:
nested state in and out, retention, discovery past a damaged file, and the one version rule."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcdist.errors import CheckpointError
from hpcdist.store import CheckpointStore, read
from tests.support.digests import digest_of


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "net": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "meta": {"lr": 0.5, "name": "run-a", "tags": ["x", "y"], "order": np.arange(5)},
    }


def test_nested_state_round_trips(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    s = state(0)
    stats = store.save(3, s, epoch=1, attrs={"note": "hello"})
    assert stats.path == tmp_path / "step_00000003.h5" and store.latest() == stats.path
    got = store.load(3)
    assert got.step == 3 and got.epoch == 1 and got.attrs["note"] == "hello"
    assert np.array_equal(got.tree["net"]["w"], s["net"]["w"].numpy())
    assert got.tree["net"]["b"].dtype == torch.bfloat16  # its bits and its dtype
    assert got.tree["meta"]["lr"] == 0.5 and got.tree["meta"]["name"] == "run-a"
    assert got.tree["meta"]["tags"] == ["x", "y"] and np.array_equal(got.tree["meta"]["order"], np.arange(5))


def test_retention_and_latest_past_a_corrupt_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        store.save(step, state(step))
    assert store.steps() == [2, 3]
    with h5py.File(store.path(3), "r+") as f:
        f["net/w"][0, 0] += 1.0
    with pytest.raises(CheckpointError, match="net/w fails its xxh3-128 check"):
        store.verify(3)
    lines: list[str] = []
    latest = store.load_latest(report=lines.append)
    assert latest is not None and latest.step == 2
    assert any("step_00000003.h5" in line and "xxh3-128" in line for line in lines), lines
    assert CheckpointStore(tmp_path / "empty").load_latest() is None


@pytest.mark.parametrize(("version", "why"), [
    (3, r"format_version 3 is newer than this hpcdist reads \(2\); upgrade hpcdist$"), (0, "is not a version")])
def test_one_version_rule(tmp_path: Path, version: int, why: str) -> None:
    path = CheckpointStore(tmp_path).save(1, state(0)).path
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = version
    with pytest.raises(CheckpointError, match=why):
        read(path)


@pytest.mark.parametrize("damage", ["no index", "stale offsets"])
def test_read_without_or_with_a_wrong_index_falls_back_to_hdf5(tmp_path: Path, damage: str) -> None:
    """Files written before `index_json` existed read the same; an index that disagrees with the
    file is not trusted (the HDF5 structure is the truth)."""
    import json

    store = CheckpointStore(tmp_path)
    s = state(4)
    path = store.save(1, s).path
    with h5py.File(path, "r+") as f:
        if damage == "no index":
            del f.attrs["index_json"]
        else:
            index = json.loads(f.attrs["index_json"])
            for entry in index["datasets"]:
                entry[1] += 8
            f.attrs["index_json"] = json.dumps(index)
    got = store.load(1)
    assert np.array_equal(got.tree["net"]["w"], s["net"]["w"].numpy())
    assert np.array_equal(got.tree["meta"]["order"], np.arange(5)) and got.tree["meta"]["tags"] == ["x", "y"]
    assert "index_json" not in got.attrs


def test_arrays_written_in_batches_and_runs_read_back_by_plain_h5py(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw writer's batching and pwritev runs (made tiny here, so arrays split across calls and
    runs end at every limit) give the same HDF5 a plain `create_dataset` would: h5py reads every
    array and its digest back, and so does the indexed read."""

    from hpcdist.store.checkpoint import rawio

    monkeypatch.setattr(rawio, "BATCH_BYTES", 1000)
    monkeypatch.setattr(rawio, "RUN_BYTES", 4096)
    monkeypatch.setattr(rawio, "IOV_MAX", 2)
    rng = np.random.default_rng(0)
    net = {
        "big": rng.standard_normal((50, 70)).astype(np.float32),  # 14000 bytes: several runs
        "ints": np.arange(300, dtype=np.int64),
        "flags": rng.random(33) > 0.5,
        "half": rng.standard_normal(7).astype(np.float16),
        "empty": np.zeros((0, 3), np.float32),
        "words": np.array([b"ab", b"cd"]),
        "deep": {"t": torch.arange(10, dtype=torch.int32), "u": np.ones(5, np.uint8)},
    }
    path = CheckpointStore(tmp_path).save(1, {"net": net}).path
    flat = {f"net/{k}": v for k, v in net.items() if k != "deep"}
    flat |= {f"net/deep/{k}": np.asarray(v) for k, v in net["deep"].items()}
    with h5py.File(path, "r") as f:
        for name, want in flat.items():
            got = f[name][()]
            assert got.dtype == want.dtype and np.array_equal(got, want), name
            assert f[name].attrs["checksum"] == digest_of(want)
    tree = read(path).tree["net"]
    assert all(np.array_equal(tree[k], v) for k, v in net.items() if k != "deep")
    assert np.array_equal(tree["deep"]["t"], np.arange(10, dtype=np.int32))


def test_a_model_with_thousands_of_arrays_is_saved_in_the_format_that_holds_its_index(tmp_path: Path) -> None:
    # The index of 3,000 arrays is an attribute of about 300 KB. In the 1.6 format (superblock 0,
    # h5py's default) an HDF5 older than 2.0 caps an attribute at 64 KiB, so such a save fails
    # there; the 1.8 format (superblock 2) stores it densely.
    tree = {"model": {f"layer{i:04d}.weight": np.full(2, i, dtype=np.float32) for i in range(3000)}}
    path = CheckpointStore(tmp_path).save(1, tree).path
    with h5py.File(path, "r") as f:
        assert len(f.attrs["index_json"]) > 64 * 1024
        assert f.id.get_create_plist().get_version()[0] >= 2  # superblock version
    got = read(path).tree["model"]
    assert len(got) == 3000 and np.array_equal(got["layer2999.weight"], [2999, 2999])


@pytest.mark.parametrize(
    "leaf",
    [np.array([1, "x", None], dtype=object), object(), [1, [2, 3]], np.array(["a", "b"])],
    ids=["object array", "object", "ragged list", "unicode array"],
)
def test_a_leaf_hdf5_cannot_store_is_named_and_nothing_is_written(tmp_path: Path, leaf: object) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, state(0))
    bad = {**state(1), "run": {"ok": 1.5, "unset": None, "bad": leaf}}
    for save in (store.save, store.save_async):  # the asynchronous save says so at the call, not later
        with pytest.raises(CheckpointError) as err:
            save(2, bad)
        message = str(err.value)
        assert "'run/bad'" in message and type(leaf).__name__ in message and "convert" in message
    assert store.wait() is None
    assert store.steps() == [1] and store.latest() == tmp_path / "step_00000001.h5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001.h5"]


# Every dtype a state_dict holds, and the float8 kinds this torch has on the CPU.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64] + [
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)]


def sample(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(str(dtype)))
    if dtype == torch.bool:
        return torch.rand(5, 3, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(5, 3, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(5, 3, generator=g) * 3).abs().to(dtype)  # e8m0 has no sign
    return torch.randint(-100 if dtype.is_signed else 0, 100, (5, 3), generator=g).to(dtype)


def test_every_tensor_dtype_comes_back_with_its_dtype_and_bits(tmp_path: Path) -> None:
    """bfloat16 and float8 (which NumPy lacks) are stored as bits with their dtype's name; every
    dtype comes back bit for bit, through the indexed read, through HDF5, after a background
    save's copy, and through ``ctx.checkpoints``' codec."""
    import json

    from hpcdist.api import decode, encode

    want = {str(d).removeprefix("torch."): sample(d) for d in DTYPES}
    store = CheckpointStore(tmp_path)
    store.save(1, {"net": want, "state": encode(want)})
    store.save_async(2, {"net": want})
    store.wait()
    path = store.path(1)
    with h5py.File(path, "r") as f:  # a plain HDF5 reader sees the bits and the dtype's name
        assert f["net/bfloat16"].dtype == np.uint16 and f["net/bfloat16"].attrs["torch_dtype"] == "bfloat16"
    hdf5_only = tmp_path / "no_index.h5"
    hdf5_only.write_bytes(path.read_bytes())
    with h5py.File(hdf5_only, "r+") as f:
        assert json.loads(f.attrs["index_json"])["dtypes"]["/net/bfloat16"] == "bfloat16"
        del f.attrs["index_json"]
    reads = {"indexed": read(path).tree["net"], "background": store.load(2).tree["net"],
             "hdf5": read(hdf5_only).tree["net"], "codec": decode(read(path).tree["state"])}
    for how, tree in reads.items():
        for name, tensor in want.items():
            got = torch.as_tensor(tree[name])
            assert got.dtype == tensor.dtype, (how, name, got.dtype)
            assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), (how, name)


def test_an_earlier_runs_checkpoints_are_never_resumed_pruned_or_mixed(tmp_path: Path) -> None:
    """Job 100 committed 1000 and 2000; job 200 saves 300, 600, 1200 there without loading (keep
    3): its first save moves job 100's files aside in one line, its pruning and `load_latest` see
    only its own run, even beside a file of job 100 put back; its requeue continues its run."""
    old = CheckpointStore(tmp_path, keep_last=3, job_id="100")
    for step in (1000, 2000):
        old.save(step, state(step))
    lines: list[str] = []
    new = CheckpointStore(tmp_path, keep_last=3, job_id="200", report=lines.append)
    for step in (300, 600, 1200):
        new.save(step, state(step))
    assert new.steps() == [300, 600, 1200]
    kept = tmp_path / "previous" / f"run-{old.run_id}"
    assert len(lines) == 1 and lines[0].startswith(f"new run {new.run_id} in {tmp_path}: moved the 2 checkpoint(s) "
                                                   f"already there (steps 1000, 2000, run {old.run_id}) and their "
                                                   f"latest to {kept}"), lines
    assert sorted(p.name for p in kept.iterdir()) == ["latest", "step_00001000.h5", "step_00002000.h5"]
    assert (tmp_path / "latest").read_text() == f"run {new.run_id}\nstep_00001200.h5\n"
    assert read(new.path(1200)).attrs["run_id"] == new.run_id and read(new.path(1200)).attrs["job_id"] == "200"

    shutil.copy(kept / "step_00001000.h5", tmp_path)  # another run's file beside this run's
    with h5py.File(new.path(1200), "r+") as f:
        f["net/w"][0, 0] += 1.0
    skipped: list[str] = []
    latest = new.load_latest(report=skipped.append)
    assert latest is not None and latest.step == 600  # never the other run's 1000
    assert any(f"step_00001000.h5: written by another run (run {old.run_id}; latest names run {new.run_id})" in line
               for line in skipped), skipped
    new.save(1300, state(1300))
    assert new.steps() == [600, 1200, 1300] and (tmp_path / "step_00001000.h5").is_file()  # pruned: 300, not 1000

    requeued = CheckpointStore(tmp_path, keep_last=3, job_id="200", report=lines.append)  # saves without loading
    requeued.save(1400, state(1400))
    assert requeued.run_id == new.run_id and len(lines) == 1 and requeued.steps() == [1200, 1300, 1400]


def test_a_fresh_start_leaves_nothing_a_requeue_could_resume(tmp_path: Path) -> None:
    """A run that starts fresh (train_gpt's ``resume: false``) moves the files it found aside at
    once: its requeue before its first commit finds nothing to resume, not the earlier run."""
    CheckpointStore(tmp_path, job_id="100").save(2000, state(0))
    lines: list[str] = []
    CheckpointStore(tmp_path, job_id="300", report=lines.append).start_run(why="params.checkpoint.resume is false")
    assert len(lines) == 1 and lines[0].startswith("params.checkpoint.resume is false: new run ")
    assert CheckpointStore(tmp_path, job_id="300").load_latest() is None
    assert [p.name for p in (tmp_path / "previous").glob("*/*.h5")] == ["step_00002000.h5"]

"""The model-agnostic checkpoint API (`hpcdist.store.CheckpointStore`) on real HDF5 files:
nested state in and out, retention, discovery past a damaged file, and the one version rule."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcdist.errors import CheckpointError
from hpcdist.store import CheckpointStore, read


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
    assert got.tree["net"]["b"].dtype == np.float32  # bfloat16 is stored as float32
    assert got.tree["meta"]["lr"] == 0.5 and got.tree["meta"]["name"] == "run-a"
    assert got.tree["meta"]["tags"] == ["x", "y"] and np.array_equal(got.tree["meta"]["order"], np.arange(5))


def test_retention_and_latest_past_a_corrupt_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        store.save(step, state(step))
    assert store.steps() == [2, 3]
    with h5py.File(store.path(3), "r+") as f:
        f["net/w"][0, 0] += 1.0
    with pytest.raises(CheckpointError, match="net/w fails its sha256 check"):
        store.verify(3)
    lines: list[str] = []
    latest = store.load_latest(report=lines.append)
    assert latest is not None and latest.step == 2
    assert any("step_00000003.h5" in line and "sha256" in line for line in lines), lines
    assert CheckpointStore(tmp_path / "empty").load_latest() is None


@pytest.mark.parametrize(("version", "why"), [(2, "newer than this hpcdist reads"), (0, "is not a version")])
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
    array and its sha256 back, and so does the indexed read."""
    import hashlib

    from hpcdist.store import rawio

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
            assert f[name].attrs["sha256"] == hashlib.sha256(np.ascontiguousarray(want).tobytes()).hexdigest()
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

"""Checkpoint format 2 (``hpcdist.store.checksum``, ``hpcdist.store.checkpoint.values``): digests that name their
algorithm (XXH3-128 by default, sha256 by choice), plain values as JSON, never a pickle; format-1
files (bare sha256, DCP's pickles) still load, a pickle that would run code is refused in one line
and runs nothing; damage (a flipped byte, a truncated or missing shard) is found with either checksum."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from hpcdist.errors import CheckpointError
from hpcdist.store import CheckpointStore, read
from hpcdist.store.sharded import checkpoint as sharded
from tests.support.cli import REPO
from tests.support.digests import digest_of

GOLDEN = REPO / "tests" / "golden" / "checkpoints-v1.tar.gz"
W = torch.arange(12, dtype=torch.float32).reshape(4, 3)
HALF = (torch.arange(6, dtype=torch.float32) / 3).to(torch.bfloat16)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def v1(tmp_path: Path) -> Path:
    """The format-1 checkpoints ``tests/golden/checkpoints-v1/make.py`` made with the hpcdist before."""
    with tarfile.open(GOLDEN) as tar:
        tar.extractall(tmp_path / "v1", filter="data")
    return tmp_path / "v1"


@pytest.fixture(params=["xxh3-128", "sha256"])
def algorithm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HPCDIST_CHECKSUM", request.param)
    return str(request.param)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_format_1_checkpoints_still_load(v1: Path) -> None:
    loaded = CheckpointStore(v1 / "plain").load_latest()
    assert loaded is not None and loaded.attrs["format_version"] == 1
    net = loaded.tree["net"]
    assert np.array_equal(net["w"], W.numpy()) and bits(net["half"]) == bits(HALF) and net["lr"] == 0.5
    state = sharded.read_full(v1 / "sharded" / "step_00000002.h5")
    assert bits(state["w"]) == bits(W) and bits(state["half"]) == bits(HALF)
    assert state["sampler"] == {"position": 7} and state["rng"] == (1, 2, None)  # DCP's pickles, read as data


def test_a_pickle_that_would_run_code_is_refused_in_one_line_and_nothing_runs(
        v1: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(v1)
    index = v1 / "pickled" / "step_00000003.h5"
    with pytest.raises(CheckpointError) as err:
        sharded.read_full(index)
    text = str(err.value)
    assert "\n" not in text and "pickled/step_00000003.shards/r00000-" in text and "entry extra" in text, text
    assert "weights_only=False" in text  # what the user may do, knowingly
    state = {"w": torch.zeros(4, 3), "extra": 0}
    assert sharded.load_latest(v1 / "pickled", state) is None  # the only step refused: nothing loaded
    assert sharded.load_latest(v1 / "pickled", {"w": torch.zeros(4, 3)}) == 3  # its tensors alone are data
    out = subprocess.run([sys.executable, "-m", "hpcdist.cli", "ckpt", "export-dcp", str(index), str(v1 / "dcp")],
                         capture_output=True, text=True, cwd=v1, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode != 0 and "entry extra" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (v1 / "hpcdist-was-run").exists()  # its os.system never ran


def test_values_are_stored_as_json_and_come_back_without_any_unpickling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"position": 7, "rng": (1, 2, None, {3: "a", (4, 5): [1.5, float("inf")]}), "nan": float("nan"),
              "np_state": ("MT19937", np.arange(4, dtype=np.uint32), 1), "blob": b"\x00\x01",
              "small": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    sharded.save(tmp_path, 1, {"w": W, "values": values})
    folder = sharded.shards_dir(tmp_path, 1)
    with h5py.File(next(folder.iterdir()), "r") as f:
        assert "bytes" not in f and {"values.position", "values.rng", "values.np_state"} <= set(f["values"])
        for dset in f["values"].values():
            json.loads(dset[()].tobytes())  # plain JSON, readable by any program
            assert dset.attrs["checksum"] == digest_of(dset[()])

    def no_unpickling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a format-2 checkpoint was unpickled")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr("pickle.loads", no_unpickling)
    monkeypatch.setattr("pickle.load", no_unpickling)
    got = sharded.read_full(tmp_path / "step_00000001.h5")["values"]
    assert bits(got.pop("small")) == bits(values.pop("small"))
    np_state = got.pop("np_state")
    assert np_state[0] == "MT19937" and np.array_equal(np_state[1], values.pop("np_state")[1])
    assert math.isnan(got.pop("nan")) and math.isnan(values.pop("nan"))
    assert got == values


def test_a_value_that_is_not_plain_data_is_refused_at_the_save(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        sharded.save(tmp_path, 1, {"w": W, "sched": {"fn": len}})
    assert "\n" not in str(err.value) and "'sched.fn'" in str(err.value) and "never a pickle" in str(err.value)
    assert not (tmp_path / "latest").exists()  # nothing committed


def test_a_dcp_folder_with_a_pickle_that_runs_code_is_refused_on_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    class Runs:
        def __reduce__(self) -> Any:
            return (os.system, ("touch hpcdist-was-run",))

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": W, "extra": Runs()}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
        with pytest.raises(CheckpointError, match="entry extra is a pickle that holds more than tensors"):
            sharded.import_dcp(tmp_path / "dcp", tmp_path / "ckpt", 0)
        dcp.save({"w": W, "position": 3}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")), no_dist=True)
        sharded.import_dcp(tmp_path / "plain", tmp_path / "ckpt", 1)  # plain values import as before
    assert not (tmp_path / "hpcdist-was-run").exists()
    assert sharded.read_full(tmp_path / "ckpt" / "step_00000001.h5")["position"] == 3


def _damage(index: Path, how: str) -> Path:
    """Damage the shard file of the sharded checkpoint `index` that holds tensor ``w``; that file."""
    md = sharded.ShardedReader(index).read_metadata()
    chunk = next(c for i, c in md.storage_data.items() if i.fqn == "w")
    path = sharded.shards_dir(index.parent, int(index.stem.split("_")[1])) / chunk.file
    if how == "flipped byte":
        with open(path, "r+b") as f:
            f.seek(chunk.offset + 3)
            byte = f.read(1)
            f.seek(chunk.offset + 3)
            f.write(bytes([byte[0] ^ 0x04]))
    elif how == "truncated shard":
        os.truncate(path, chunk.offset + 8)
    else:
        path.unlink()
    return path


@pytest.mark.parametrize("how", ["flipped byte", "truncated shard", "missing shard"])
def test_damaged_shards_are_named_and_the_previous_step_used_with_either_checksum(
        tmp_path: Path, algorithm: str, how: str) -> None:
    for step in (1, 2):
        sharded.save(tmp_path, step, {"w": W + step, "sampler": {"position": step}})
    with h5py.File(tmp_path / "step_00000002.h5", "r") as f:
        assert f.attrs["checksum"] == algorithm and f.attrs["format_version"] == 2
    path = _damage(tmp_path / "step_00000002.h5", how)
    state, skipped = {"w": torch.zeros(4, 3), "sampler": {"position": 0}}, []
    assert sharded.load_latest(tmp_path, state, report=skipped.append) == 1
    assert torch.equal(state["w"], W + 1) and state["sampler"]["position"] == 1
    assert len(skipped) == 1 and str(path) in skipped[0] and "\n" not in skipped[0], skipped
    assert {"flipped byte": f"tensor w (dataset /tensors/w/0_0, written by rank 0) does not match its {algorithm}",
            "truncated shard": "lies past the end of the file; truncated",
            "missing shard": "No such file"}[how] in skipped[0], skipped[0]


def test_an_unsharded_checkpoint_with_sha256_chosen_records_and_checks_sha256(tmp_path: Path) -> None:
    path = CheckpointStore(tmp_path).save(1, {"net": {"w": W}}).path
    fast = CheckpointStore(tmp_path / "s")
    from hpcdist.store.checkpoint import single as checkpoints

    slow = checkpoints.save(fast.directory, 1, {"net": {"w": W}}, checksum="sha256").path
    with h5py.File(path, "r") as f, h5py.File(slow, "r") as g:
        assert f["net/w"].attrs["checksum"] == digest_of(W.numpy(), "xxh3-128")
        assert g["net/w"].attrs["checksum"] == digest_of(W.numpy(), "sha256") and g.attrs["checksum"] == "sha256"
    assert np.array_equal(read(slow).tree["net"]["w"], W.numpy())
    with pytest.raises(CheckpointError, match=r"checksum 'md5' is not a checksum this hpcdist knows; use one of"):
        checkpoints.save(tmp_path / "x", 1, {"w": W}, checksum="md5")
    shutil.rmtree(tmp_path / "x", ignore_errors=True)


def test_the_site_chooses_the_checksum_and_the_job_overrides_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcdist.config import load_site
    from hpcdist.errors import ConfigError
    from hpcdist.store import checksum

    monkeypatch.delenv("HPCDIST_CHECKSUM", raising=False)
    monkeypatch.setattr(checksum, "_site", None)
    monkeypatch.setattr(checksum, "_chosen", None)
    site = load_site(None, ["storage.checksum=sha256"])
    checksum.use_site(site.storage.checksum)  # what every rank of a job on that site does first

    def written(step: int) -> str:
        with h5py.File(CheckpointStore(tmp_path).save(step, {"w": W}).path, "r") as f:
            return str(f.attrs["checksum"])

    assert written(1) == "sha256"
    monkeypatch.setenv("HPCDIST_CHECKSUM", "xxh3-128")  # the job's env
    assert written(2) == "xxh3-128"
    checksum.use("sha256")  # hpcdist.init(checksum=...), a training job's checkpoint.checksum
    assert written(3) == "sha256"
    with pytest.raises(ConfigError, match="storage.checksum"):
        load_site(None, ["storage.checksum=md5"])

"""The checkpoint contract: names and shapes, the latest pointer, checksums, model mismatch."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcdist.errors import CheckpointError
from hpcdist.infer.shard_load import read_shard
from hpcdist.model.checkpoint import parameter_shapes as expected_shapes
from hpcdist.model.checkpoint import read_full, read_header
from hpcdist.model.gpt import GPT, GPTConfig
from hpcdist.store import resolve
from tests.support.infer import TINY, make_checkpoint


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_expected_shapes_are_the_models_state_dict_without_the_tied_head(mlp: str) -> None:
    cfg = TINY.model_copy(update={"mlp": mlp})
    state = GPT(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items() if k != "lm_head.weight"} == expected_shapes(cfg)


def test_directory_follows_latest_and_full_read_equals_the_model(tmp_path: Path) -> None:
    file, model = make_checkpoint(tmp_path, step=7)
    assert resolve(tmp_path) == file
    assert (tmp_path / "latest").read_text().strip() == "step_00000007.h5"
    header = read_header(tmp_path)
    assert header.step == 7 and header.config == TINY
    full = read_full(header)
    assert "lm_head.weight" not in full
    for key, value in model.state_dict().items():
        if key != "lm_head.weight":
            assert torch.equal(full[key], value), key


def test_directory_without_latest_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        resolve(tmp_path)


def _corrupt(file: Path, key: str) -> None:
    with h5py.File(file, "r+") as f:
        ds = f["model"][key]
        arr = ds[()]
        arr.flat[0] += 1.0
        ds[...] = arr


def test_full_read_rejects_a_changed_tensor(tmp_path: Path) -> None:
    file, _ = make_checkpoint(tmp_path)
    _corrupt(file, "transformer.h.1.mlp.c_fc.weight")
    with pytest.raises(CheckpointError, match=r"transformer.h.1.mlp.c_fc.weight does not match its sha256"):
        read_full(read_header(file))


def test_shard_reads_verify_sharded_tensors_across_ranks(tmp_path: Path) -> None:
    """A changed sharded tensor is caught by exactly the rank assigned to verify it."""
    file, _ = make_checkpoint(tmp_path)
    key = "transformer.h.0.attn.c_attn.weight"
    _corrupt(file, key)
    header = read_header(file)
    reads = [read_shard(header, tp_rank=r % 2, tp=2, rank=r, world_size=2) for r in range(2)]
    assert sum(key in r.bad for r in reads) == 1
    assert set(reads[0].verified) | set(reads[1].verified) == set(header.shapes)


def test_checkpoint_of_another_model_is_refused_with_the_difference(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"n_layer: spec 3 vs checkpoint 2"):
        read_header(tmp_path, expect=TINY.model_copy(update={"n_layer": 3}))


def test_tensor_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    file, _ = make_checkpoint(tmp_path)
    with h5py.File(file, "r+") as f:
        f.attrs["model_config_json"] = GPTConfig(**{**TINY.model_dump(), "d_model": 64}).model_dump_json()
    with pytest.raises(CheckpointError, match="wrong shape"):
        read_header(file)


def test_written_sha256_matches_the_bytes(tmp_path: Path) -> None:
    import hashlib

    file, model = make_checkpoint(tmp_path)
    w = model.state_dict()["transformer.wpe.weight"]
    with h5py.File(file, "r") as f:
        assert f["model/transformer.wpe.weight"].attrs["sha256"] == hashlib.sha256(w.numpy().tobytes()).hexdigest()
        assert f["model/transformer.wpe.weight"].dtype == np.float32
        assert f.attrs["format"] == "hpcdist.checkpoint" and f.attrs["format_version"] == 1
    assert torch.equal(w, read_full(read_header(file))["transformer.wpe.weight"])

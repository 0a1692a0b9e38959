"""The checkpoint format and its faults, on real HDF5 files: atomic commit, checksums, the
`latest` pointer, retention, a killed writer, truncation, a flipped byte, a full disk, and a
model of another shape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcdist import store
from hpcdist.errors import CheckpointError
from hpcdist.model import checkpoint as gpt_ckpt
from hpcdist.model.gpt import GPT, GPTConfig
from hpcdist.model.shapes import check_shapes
from hpcdist.store.checkpoint import directory as layout
from tests.support.cli import REPO
from tests.support.digests import digest_of

CFG = GPTConfig(vocab_size=61, context=16, n_layer=2, n_head=2, d_model=16)


def model(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def save_model(directory: Path, step: int, m: GPT, keep_last: int | None = None, extra: dict | None = None) -> Path:
    tree = {"model": gpt_ckpt.model_tree(m.state_dict()), **(extra or {})}
    return store.save(directory, step, tree, epoch=0, attrs=gpt_ckpt.model_attrs(m.cfg), keep_last=keep_last).path


def test_layout_follows_the_contract(tmp_path: Path) -> None:
    m = model()
    path = save_model(tmp_path, 7, m, extra={"sampler": {"epoch": 3, "position": 96, "order": np.arange(4)}})
    assert path.name == "step_00000007.h5"
    assert (tmp_path / "latest").read_text().strip() == "step_00000007.h5"
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "hpcdist.checkpoint" and f.attrs["format_version"] == 2
        assert f.attrs["checksum"] == "xxh3-128"
        assert f.attrs["step"] == 7 and f.attrs["epoch"] == 0 and f.attrs["created"]
        assert GPTConfig.model_validate_json(f.attrs["model_config_json"]) == CFG
        keys = set(m.state_dict()) - {"lm_head.weight"}
        assert set(f["model"].keys()) == keys
        assert json.loads(f["model"].attrs["tied_json"]) == {"lm_head.weight": "transformer.wte.weight"}
        for key in keys:
            d = f["model"][key]
            arr = m.state_dict()[key].numpy()
            assert d.dtype == np.float32 and d.shape == arr.shape
            assert d.attrs["checksum"] == digest_of(arr)
        assert f["sampler"].attrs["position"] == 96 and f["sampler/order"].attrs["checksum"]


def test_load_model_state_gives_the_same_model(tmp_path: Path) -> None:
    m = model(1)
    path = save_model(tmp_path, 1, m)
    cfg, state = gpt_ckpt.load_model_state(path)
    fresh = GPT(cfg)
    fresh.load_state_dict(state)  # strict: the tied head is restored too
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    assert torch.equal(fresh(x), m(x))


def test_retention_keeps_the_newest_and_deletes_only_after_commit(tmp_path: Path) -> None:
    m = model()
    for step in (10, 20, 30, 40):
        save_model(tmp_path, step, m, keep_last=2)
    assert [p.name for p in store.checkpoints_in(tmp_path)] == ["step_00000040.h5", "step_00000030.h5"]
    assert store.find_latest(tmp_path) == tmp_path / "step_00000040.h5"


def _flip_byte_in(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    assert offset is not None
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture(params=["xxh3-128", "sha256"])
def algorithm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The checksum a job chose (``HPCDIST_CHECKSUM``): the default, and sha256 for those who want it."""
    monkeypatch.setenv("HPCDIST_CHECKSUM", request.param)
    return str(request.param)


@pytest.fixture
def two(tmp_path: Path, algorithm: str) -> tuple[Path, Path]:
    m = model()
    return save_model(tmp_path, 10, m), save_model(tmp_path, 20, m)


def test_flipped_byte_is_caught_and_the_older_one_used(tmp_path: Path, two: tuple[Path, Path], algorithm: str) -> None:
    old, new = two
    with h5py.File(new, "r") as f:
        assert f.attrs["checksum"] == algorithm
        assert f["model/transformer.wpe.weight"].attrs["checksum"] == digest_of(f["model/transformer.wpe.weight"][()],
                                                                                algorithm)
    _flip_byte_in(new, "model/transformer.h.1.mlp.c_fc.weight")
    with pytest.raises(CheckpointError, match=f"transformer.h.1.mlp.c_fc.weight fails its {algorithm} check"):
        store.read(new)
    lines: list[str] = []
    assert store.find_latest(tmp_path, report=lines.append) == old
    assert any(str(new) in line and algorithm in line for line in lines), lines


def test_truncated_file_is_skipped(tmp_path: Path, two: tuple[Path, Path]) -> None:
    old, new = two
    with open(new, "r+b") as fh:
        fh.truncate(new.stat().st_size // 2)
    lines: list[str] = []
    assert store.find_latest(tmp_path, report=lines.append) == old
    assert any(str(new) in line and "truncated or corrupt" in line for line in lines), lines


@pytest.mark.parametrize("content", ["", "step_00000099.h5\n", "../../etc/passwd\n"])
def test_bad_pointer_falls_back_to_the_newest_good_file(tmp_path: Path, two: tuple[Path, Path], content: str) -> None:
    _, new = two
    (tmp_path / "latest").write_text(content)
    lines: list[str] = []
    assert store.find_latest(tmp_path, report=lines.append) == new
    why = {"": "is empty", "step_00000099.h5\n": "which does not exist", "../../etc/passwd\n": "not a checkpoint name"}
    assert why[content] in lines[0], lines


def test_file_newer_than_the_commit_is_not_trusted(tmp_path: Path, two: tuple[Path, Path]) -> None:
    old, new = two
    layout.write_pointer(tmp_path, old.name)  # as if the writer died between rename and commit
    lines: list[str] = []
    assert store.find_latest(tmp_path, report=lines.append) == old
    assert any(str(new) in line and "after the last commit" in line for line in lines)


def test_writer_killed_mid_write_leaves_the_last_commit_intact(tmp_path: Path) -> None:
    """A real writer process, SIGKILLed while its temporary file is being written."""
    first = save_model(tmp_path, 1, model())
    script = textwrap.dedent(f"""
        import numpy as np, time
        from hpcdist import store
        big = {{f"w{{i}}": np.full((256, 1024), i, np.float32) for i in range(400)}}  # 400 MiB
        store.save({str(tmp_path)!r}, 2, {{"model": big}}, epoch=0, attrs={{"model_config_json": "{{}}"}})
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 60
        while not [p for p in layout.temporaries_in(tmp_path) if p.stat().st_size > 1 << 20]:
            assert proc.poll() is None, "the writer finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert layout.temporaries_in(tmp_path), "the killed writer should have left its temporary file"
    assert not (tmp_path / "step_00000002.h5").exists()
    found = store.scan(tmp_path)
    assert found.latest == first and found.temporaries
    assert "writer was killed" in found.report()[-1]
    layout.remove_temporaries(tmp_path)
    assert not layout.temporaries_in(tmp_path)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB file system (tmpfs), so writing fills it for real; 0755 (a tmpfs is 1777 by
    default: a folder everyone may write is no checkpoint folder to resume from)."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_no_space_left_keeps_the_previous_checkpoint(tiny_disk: Path) -> None:
    first = save_model(tiny_disk, 1, model())  # ~60 KB
    big = {"model": {f"w{i}": np.ones((256, 256), np.float32) for i in range(16)}}  # 4 MiB > the disk
    with pytest.raises(CheckpointError) as err:
        store.save(tiny_disk, 2, big, epoch=0, attrs={"model_config_json": "{}"})
    msg = str(err.value)
    assert str(tiny_disk / "step_00000002.h5") in msg and "no space left" in msg
    assert f"{first} is intact" in msg
    assert not layout.temporaries_in(tiny_disk) and not (tiny_disk / "step_00000002.h5").exists()
    assert store.find_latest(tiny_disk) == first


def test_other_model_shape_lists_the_mismatched_tensors(tmp_path: Path) -> None:
    path = save_model(tmp_path, 1, model())
    other = GPT(CFG.model_copy(update={"d_model": 32, "n_layer": 3}))
    expected = {k: tuple(v.shape) for k, v in other.state_dict().items() if k != "lm_head.weight"}
    with h5py.File(path) as f:
        found = {k: d.shape for k, d in f["model"].items()}
    with pytest.raises(CheckpointError) as err:
        check_shapes(path, expected, found)
    msg = str(err.value)
    assert "transformer.wte.weight: checkpoint [61, 16] vs model [61, 32]" in msg
    assert "transformer.h.2.ln_1.weight: missing in checkpoint" in msg
    assert "different model shape" in msg

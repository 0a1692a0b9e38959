"""The checkpoint contract: names and shapes, the latest pointer, checksums, model mismatch."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcdist.errors import CheckpointError
from hpcdist.infer.shard_load import read_shard, shard_state
from hpcdist.model.checkpoint import read_full, read_header
from hpcdist.model.gpt import GPT, GPTConfig
from hpcdist.model.shapes import parameter_shapes as expected_shapes
from hpcdist.store import resolve
from tests.support.infer import TINY, make_checkpoint, make_sharded_checkpoint


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
    with pytest.raises(CheckpointError, match=r"transformer.h.1.mlp.c_fc.weight does not match its checksum"):
        read_full(read_header(file))


def test_shard_reads_verify_every_tensor_each_rank_takes_a_part_of(tmp_path: Path) -> None:
    """A changed sharded tensor is caught by every rank that uses part of it: no rank uses bytes
    that only another rank checked (each has read them itself)."""
    file, _ = make_checkpoint(tmp_path)
    key = "transformer.h.0.attn.c_attn.weight"
    _corrupt(file, key)
    header = read_header(file)
    reads = [read_shard(header, tp_rank=r % 2, tp=2, rank=r, world_size=2) for r in range(2)]
    assert all(r.bad == [key] for r in reads)
    assert all(set(r.verified) == set(header.shapes) for r in reads)


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


def test_written_checksum_matches_the_bytes(tmp_path: Path) -> None:
    from tests.support.digests import digest_of

    file, model = make_checkpoint(tmp_path)
    w = model.state_dict()["transformer.wpe.weight"]
    with h5py.File(file, "r") as f:
        assert f["model/transformer.wpe.weight"].attrs["checksum"] == digest_of(w.numpy())
        assert f["model/transformer.wpe.weight"].dtype == np.float32
        assert f.attrs["format"] == "hpcdist.checkpoint" and f.attrs["format_version"] == 2
    assert torch.equal(w, read_full(read_header(file))["transformer.wpe.weight"])


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    """TINY saved by FSDP2 at 2 ranks: each tensor in 2 chunks of rows, the vocabulary's uneven (129 + 128)."""
    return make_sharded_checkpoint(tmp_path_factory.mktemp("fsdp") / "ckpt")


def test_a_sharded_checkpoint_has_the_header_and_the_full_read_of_a_whole_one(fsdp: tuple[Path, GPT],
                                                                             tmp_path: Path) -> None:
    index, model = fsdp
    header = read_header(index.parent)
    whole = read_header(make_checkpoint(tmp_path)[0])
    assert header.sharded and (header.config, header.shapes, header.dtypes) == (whole.config, whole.shapes,
                                                                               whole.dtypes)
    assert header.pieces is not None and [p.sizes for p in header.pieces["transformer.wte.weight"]] == [
        (129, 32), (128, 32)]
    full = read_full(header)
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items() if k != "lm_head.weight")


def _flip(index: Path, key: str, rank: int) -> None:
    """One bit of the chunk of `key` that `rank` wrote."""
    from hpcdist.store.sharded import checkpoint as sharded

    md = sharded.ShardedReader(index).read_metadata()
    chunk = next(c for i, c in md.storage_data.items() if i.fqn == f"model.{key}" and c.rank == rank)
    with open(sharded.shards_dir(index.parent, 3) / chunk.file, "r+b") as f:
        f.seek(chunk.offset + 3)
        byte = f.read(1)
        f.seek(chunk.offset + 3)
        f.write(bytes([byte[0] ^ 0x04]))


def test_shard_reads_of_a_sharded_checkpoint_are_each_tp_ranks_slices_and_verify_every_chunk_once(
        fsdp: tuple[Path, GPT], tmp_path: Path) -> None:
    """At tp 2 a rank's q, k and v rows of c_attn lie in both FSDP chunks, its c_proj columns in every
    row of both: each rank gets what slicing the whole model gives, from chunks it checked itself."""
    index, model = fsdp
    header = read_header(index)
    reads = [read_shard(header, tp_rank=r, tp=2, rank=r, world_size=2) for r in range(2)]
    for r, read in enumerate(reads):
        want = shard_state(dict(model.state_dict()), header.config, r, 2)
        assert read.bad == [] and all(torch.equal(read.state[k], want[k]) for k in header.shapes)
    chunks = [set(read.verified) for read in reads]
    assert len(chunks[0] | chunks[1]) == 2 * len(header.shapes)  # every chunk, by each rank that takes from it
    assert all(len([c for c in mine if c.startswith("transformer.h.0.attn.c_attn.weight ")]) == 2 for mine in chunks)

    shutil.copytree(index.parent, tmp_path / "ckpt")
    _flip(tmp_path / "ckpt" / index.name, "transformer.h.1.attn.c_proj.weight", rank=1)
    header = read_header(tmp_path / "ckpt")
    reads = [read_shard(header, tp_rank=r, tp=2, rank=r, world_size=2) for r in range(2)]
    assert [r.bad for r in reads] == [["transformer.h.1.attn.c_proj.weight"]] * 2  # both use part of it
    with pytest.raises(CheckpointError, match=r"tensor model.transformer.h.1.attn.c_proj.weight .*written by rank 1"):
        read_full(header)


@pytest.mark.parametrize("load", ["shard", "broadcast"])
def test_infer_gpt_generates_from_a_checkpoint_fsdp_wrote(fsdp: tuple[Path, GPT], tmp_path: Path, load: str) -> None:
    """The inference job on the local site, tp 2, from the directory a `parallel: fsdp` run saves into:
    the tokens one process generates greedily from the model that was saved. `shard`: each rank reads its
    slices; `broadcast`: rank 0 reads every chunk and the ranks check what they received against its hashes."""
    from hpcdist.data.tokenizer import BYTES
    from hpcdist.infer.generate import Sampling, generate
    from hpcdist.infer.tp import TPGPT, TPGroup
    from tests.support.cli import run_cli, storage_sets

    index, model = fsdp
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe cluster runs jobs\nab\n")
    run = run_cli("submit", "jobs/infer_gpt.yaml", "--site", "local", "--wait", *storage_sets(tmp_path),
                  "--set", f"params.prompts={prompts}", "--set", f"params.checkpoint={index.parent}",
                  "--set", f"params.load={load}", "--set", "params.max_new_tokens=10", timeout=240)
    assert run.code == 0, run.text
    (path,) = (tmp_path / "results" / "infer_gpt").glob("*.h5")
    with h5py.File(path, "r") as f:
        asked = [list(map(int, p)) for p in f["tokens/prompt_ids"]]
        outputs = [list(map(int, o)) for o in f["tokens/output_ids"]]
        assert f.attrs["checkpoint"] == str(index) and f["load"].attrs["method"] == load
    whole = TPGPT(TINY, TPGroup())
    whole.load_shard({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    assert outputs == generate(whole, asked, Sampling(max_new_tokens=10, end_token=BYTES.eot_id)).tokens
    assert sum(map(len, outputs)) > 3 and outputs[0] != outputs[2]


PROBE = """
import contextlib, io, json, sys
from hpcdist.cli import main
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules}))
"""


def test_the_login_side_checks_an_infer_spec_against_a_sharded_checkpoint_without_torch(
        fsdp: tuple[Path, GPT], tmp_path: Path) -> None:
    """`hpcdist render` (and `submit`) read the index's metadata as JSON: a spec whose model differs
    is refused in one line naming the difference, and torch is never imported."""
    import json
    import subprocess
    import sys

    from tests.support.cli import REPO

    (tmp_path / "prompts.txt").write_text("hello\n")
    sets = ["--set", f"params.checkpoint={fsdp[0].parent}", "--set", f"params.prompts={tmp_path / 'prompts.txt'}"]
    for extra, code in (([], 0), (["--set", "params.model.n_layer=3"], 1)):
        proc = subprocess.run([sys.executable, "-c", PROBE, "render", "jobs/infer_gpt.yaml", "--site", "local",
                               *sets, *extra], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=120, check=True)
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert (out["code"] != 0) == bool(code) and not out["torch"], out
    assert "n_layer: spec 3 vs checkpoint 2" in out["err"] and out["err"].count("\n") == 1

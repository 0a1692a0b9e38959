"""Token data and the distributed order: `hpcdist data prepare`, the tokenizers, and a sampler
whose order depends only on the seed and the epoch."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdist.data.dataset import DistributedOrder, TokenWindows
from hpcdist.data.tokenizer import ByteTokenizer
from hpcdist.errors import JobError
from tests.support.cli import require_module, run_cli
from tests.support.train import write_corpus


def test_prepare_writes_both_splits_of_every_file(tmp_path: Path) -> None:
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text("héllo world " * 50)
    b.write_bytes(b"second file\n" * 30)
    out = tmp_path / "tokens.h5"
    result = run_cli("data", "prepare", str(a), str(b), "-o", str(out), "--val-fraction", "0.2")
    assert result.code == 0, result.text
    assert "tokenizer bytes (vocabulary 257) from 2 file(s)" in result.out
    with h5py.File(out) as f:
        assert f.attrs["format"] == "hpcdist.tokens" and f.attrs["vocab_size"] == 257 and f.attrs["eot_id"] == 256
        train, val = f["train"][()], f["val"][()]
        assert train.dtype == np.uint16
        assert [Path(s).name for s in f.attrs["sources"].astype(str)] == ["a.txt", "b.txt"]
    na, nb = len(a.read_bytes()), len(b.read_bytes())
    # each document split on its own, each piece followed by end-of-text
    assert len(train) + len(val) == na + nb + 4
    assert (train == 256).sum() == 2 and (val == 256).sum() == 2
    tok = ByteTokenizer()
    first = train[: np.flatnonzero(train == 256)[0]]
    assert tok.decode(first) + tok.decode(val[: np.flatnonzero(val == 256)[0]]) == a.read_text()


def test_prepare_with_a_local_tokenizers_file(tmp_path: Path) -> None:
    tokenizers = require_module("tokenizers")
    corpus = write_corpus(tmp_path / "corpus.txt", words=2000)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train([str(corpus)], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "tokens.h5"
    result = run_cli("data", "prepare", str(corpus), "-o", str(out), "--tokenizer", str(tmp_path / "tokenizer.json"))
    assert result.code == 0, result.text
    with h5py.File(out) as f:
        assert f.attrs["tokenizer"] == "tokenizers:tokenizer.json"
        assert f.attrs["vocab_size"] == tok.get_vocab_size()
        assert f.attrs["eot_id"] == tok.token_to_id("<|endoftext|>")
        ids = f["train"][()]
    assert ids.max() < tok.get_vocab_size() and len(ids) < len(corpus.read_bytes()) / 2  # merges happened


def test_prepare_names_a_missing_file(tmp_path: Path) -> None:
    result = run_cli("data", "prepare", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "t.h5"))
    assert result.code == 2 and "cannot read" in result.err and "nope.txt" in result.err


def order(world: int, rank: int, micro: int, accum: int, seed: int = 7, n: int = 1000) -> DistributedOrder:
    return DistributedOrder(n, world, rank, micro, accum, seed)


def test_order_depends_only_on_seed_and_epoch() -> None:
    a, b = order(2, 0, 4, 2), order(2, 0, 4, 2)
    assert np.array_equal(a.permutation(3), b.permutation(3))
    assert not np.array_equal(a.permutation(3), a.permutation(4))
    assert not np.array_equal(a.permutation(3), order(2, 0, 4, 2, seed=8).permutation(3))
    assert sorted(a.permutation(5)) == list(range(1000))


def test_a_step_reads_the_same_samples_however_the_batch_is_split() -> None:
    """World x micro x accum = 16 in each layout: the step's samples are the same set."""
    layouts = [(1, 16, 1), (2, 8, 1), (2, 4, 2), (4, 2, 2), (2, 2, 4)]
    for position in (0, 16, 48):
        sets = []
        for world, micro, accum in layouts:
            parts = [order(world, r, micro, accum).step_samples(2, position) for r in range(world)]
            got = [s for rank_part in parts for mb in rank_part for s in mb]
            assert len(got) == len(set(got)) == 16  # ranks never overlap
            sets.append(sorted(got))
        assert all(s == sets[0] for s in sets)
    # consecutive steps cover the epoch without repeats
    o = order(2, 0, 4, 2)
    seen = [s for p in range(0, o.steps_per_epoch * 16, 16) for r in (0, 1)
            for mb in order(2, r, 4, 2).step_samples(0, p) for s in mb]
    assert len(seen) == len(set(seen)) == o.steps_per_epoch * 16


def test_too_little_data_for_one_batch_is_an_error() -> None:
    with pytest.raises(JobError, match="fewer than one global batch of 64"):
        DistributedOrder(50, 4, 0, 8, 2, 0)


def test_windows_are_inputs_and_shifted_targets(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(bytes(range(200)))
    out = tmp_path / "t.h5"
    assert run_cli("data", "prepare", str(corpus), "-o", str(out), "--val-fraction", "0").code == 0
    windows = TokenWindows(out, "train", 10)
    assert len(windows) == (201 - 1) // 10
    x, y = windows.batch(np.array([3, 0]))
    assert x[0].tolist() == list(range(30, 40)) and y[0].tolist() == list(range(31, 41))
    assert x[1].tolist() == list(range(10))
    windows.close()

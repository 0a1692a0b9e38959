"""An imported GPT-2 at work: its tokenizer prepares the data, train_gpt fine-tunes from it
(``params.init``) and records the tokenizer in every checkpoint, infer_gpt generates with it, on
the local site and across two Slurm nodes; data of another tokenizer is refused."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import h5py
import pytest

from hpcdist.data.tokenizer import read_tokenizer
from hpcdist.store.results import read_attrs
from tests.support.cli import SHARED, Run, require_slurm, run_cli, storage_sets
from tests.support.hf import VOCAB, Pretrained
from tests.support.train import model_arrays, write_corpus

FINETUNE = ["--set", "params.steps=4", "--set", "params.optim.lr=1e-6", "--set", "params.optim.warmup_steps=0",
            "--set", "params.eval.every=0", "--set", "params.checkpoint.every=2", "--set", "timeout_s=120"]
PROMPTS = "the quick brown\nfox jumps over\nlazy dog\n"


def _prepare(root: Path, tokenizer: Path | None) -> Path:
    out = root / ("tokens.h5" if tokenizer else "bytes.h5")
    extra = ["--tokenizer", str(tokenizer)] if tokenizer else []
    result = run_cli("data", "prepare", str(write_corpus(root / "corpus.txt", words=6000)), "-o", str(out), *extra)
    assert result.code == 0, result.text
    return out


def _finetune(root: Path, init: Path, tokens: Path, *extra: str, site: str = "local") -> Run:
    return run_cli("submit", "jobs/finetune_gpt.yaml", "--site", site, "--wait", *storage_sets(root),
                   "--set", f"params.init={init}", "--set", f"params.data={tokens}", *FINETUNE, *extra, timeout=300)


def _infer(root: Path, checkpoint: str, *extra: str, site: str = "local") -> Path:
    prompts = root / "prompts.txt"
    prompts.write_text(PROMPTS)
    result = run_cli("submit", "jobs/infer_gpt.yaml", "--site", site, "--wait", *storage_sets(root),
                     "--set", f"params.checkpoint={checkpoint}", "--set", f"params.prompts={prompts}",
                     "--set", "params.max_new_tokens=8", *extra, timeout=300)
    assert result.code == 0, result.text
    (path,) = (root / "results" / "infer_gpt").glob("*.h5")
    return path


def _check_finetuned(root: Path, init: Path) -> Path:
    """The last checkpoint started from `init` (a tiny lr moved it a little) and carries its tokenizer."""
    last = root / "checkpoints" / "finetune_gpt" / "step_00000004.h5"
    before, after = model_arrays(init), model_arrays(last)
    moved = max(float(abs(after[k] - before[k]).max()) for k in before)
    assert 0 < moved < 1e-4, moved  # a fresh random init would differ by ~0.1
    assert read_tokenizer(last).identity == read_tokenizer(init).identity
    return last


def test_finetune_and_generate_from_an_imported_model(tmp_path: Path, pretrained: Pretrained) -> None:
    from hpcdist.infer.hf import hf_generate_greedy

    tokens = _prepare(tmp_path, pretrained.checkpoint)
    tok = read_tokenizer(tokens)
    assert tok.identity == read_tokenizer(pretrained.checkpoint).identity and tok.vocab_size == VOCAB
    result = _finetune(tmp_path, pretrained.checkpoint, tokens)
    assert result.code == 0, result.text
    _check_finetuned(tmp_path, pretrained.checkpoint)

    # generation from the imported checkpoint: prompts encoded, outputs decoded, by its tokenizer,
    # and the greedy tokens are transformers' own on the same prompts
    path = _infer(tmp_path, str(pretrained.checkpoint))
    prompts = [tok.encode_text(p) for p in PROMPTS.splitlines()]
    want = hf_generate_greedy(pretrained.model, prompts, 8, tok.eot_id)
    assert read_attrs(path)["tokenizer"] == tok.name
    with h5py.File(path, "r") as f:
        assert [list(r) for r in f["tokens/prompt_ids"]] == prompts
        got = [list(r) for r in f["tokens/output_ids"]]
        texts = [t.decode() if isinstance(t, bytes) else t for t in f["requests/output"][()]]
    assert got == want
    assert texts == [tok.decode(ids) for ids in got]


def test_data_of_another_tokenizer_is_refused(tmp_path: Path, pretrained: Pretrained) -> None:
    tuned, wrong = _prepare(tmp_path, pretrained.checkpoint), _prepare(tmp_path, None)
    refused = _finetune(tmp_path, pretrained.checkpoint, wrong)
    assert refused.code == 2 and "params.data" in refused.err, refused.text
    assert "was prepared with tokenizer bytes" in refused.err and "--tokenizer" in refused.err
    # resuming the fine-tuned run with byte-tokenised text of the same vocabulary size
    assert _finetune(tmp_path, pretrained.checkpoint, tuned).code == 0
    model = f"{{vocab_size: {VOCAB}, context: 64, n_layer: 2, n_head: 4, d_model: 32}}"
    result = _finetune(tmp_path, pretrained.checkpoint, wrong, "--set", "params.init=null",
                       "--set", f"params.model={model}", "--set", "params.steps=6")
    assert result.code != 0
    assert "was prepared with tokenizer bytes" in result.text and "step_00000004.h5" in result.text, result.text


@pytest.mark.slurm
def test_finetune_and_generate_across_two_slurm_nodes(pretrained: Pretrained) -> None:
    require_slurm()
    root = SHARED / f"t-hf-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True)
        init = Path(shutil.copy(pretrained.checkpoint, root / "gpt2.h5"))
        tokens = _prepare(root, init)
        two = ["--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1"]
        result = _finetune(root, init, tokens, *two, site="local-slurm")
        assert result.code == 0, result.text
        _check_finetuned(root, init)
        path = _infer(root, "finetune_gpt", *two, site="local-slurm")
        attrs = read_attrs(path)
        assert attrs["num_nodes"] == 2 and attrs["tokenizer"] == read_tokenizer(init).name
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_init_fixes_the_model_shape(tmp_path: Path, pretrained: Pretrained) -> None:
    from hpcdist.config import load_site
    from hpcdist.errors import ConfigError
    from hpcdist.kinds.registry import load_job

    tokens = _prepare(tmp_path, pretrained.checkpoint)
    site = load_site("local", [s.removeprefix("site.") for s in storage_sets(tmp_path)[1::2]])
    sets = [f"params.init={pretrained.checkpoint}", f"params.data={tokens}"]
    load_job(Path("jobs/finetune_gpt.yaml"), site, [*sets, "params.model.dropout=0.1"])  # dropout may change
    with pytest.raises(ConfigError, match=r"params.model: .*'n_layer': 3.* differs from params.init's model"):
        load_job(Path("jobs/finetune_gpt.yaml"), site, [*sets, "params.model.n_layer=3"])

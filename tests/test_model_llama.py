"""LLaMA, Mistral and Qwen2 (``hpcdist model import/export``, tensor-parallel generation): logits equal
transformers' after import, under tensor parallelism (KV heads split and replicated) and after
export; greedy generation token-identical to ``generate``; what cannot be computed exactly is
refused in one line. Every model and tokenizer is made here with random weights: nothing is
downloaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist.errors import ConfigError
from hpcdist.model.checkpoint import checkpoint_chat_template, checkpoint_tokenizer, load_model_state, read_header
from hpcdist.model.gpt import GPT
from tests.support.cli import require_module
from tests.support.hf import cli
from tests.support.infer import run_ranks
from tests.support.llama import TEMPLATE, VARIANTS, VOCAB, make_llama
from tests.support.train import write_corpus

require_module("transformers")

TOOLS = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}<tools>"  # a named template
ATOL = 2e-5  # the bound: float32 sums in another order (GQA, rotary, all-reduced partial sums)


@dataclass(frozen=True)
class Imported:
    directory: Path
    checkpoint: Path
    model: Any


_CACHE: dict[str, Imported] = {}


def imported(root: Path, variant: str, capsys: pytest.CaptureFixture[str]) -> Imported:
    """`variant` made and imported through the CLI once per session (the llama3 one sharded, in the old config form)."""
    if variant not in _CACHE:
        folder, out = root / variant, root / f"{variant}.h5"
        model = make_llama(folder, variant, old_config=variant == "llama3-gqa", shard=variant == "llama3-gqa")
        code, text, err = cli(capsys, "model", "import", str(folder), "-o", str(out))
        assert code == 0, err
        assert f"wrote {out}" in text and "chat template" in text
        _CACHE[variant] = Imported(folder, out, model)
    return _CACHE[variant]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama")


def _ids(n: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model: Any, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_gives_transformers_logits(root: Path, capsys: pytest.CaptureFixture[str], variant: str) -> None:
    from transformers import AutoTokenizer

    got = imported(root, variant, capsys)
    if variant == "llama3-gqa":
        assert (got.directory / "model.safetensors.index.json").is_file()  # sharded weights read
    cfg, state = load_model_state(got.checkpoint)
    assert (cfg.family, cfg.norm, cfg.positions) == (VARIANTS[variant]["family"], "rmsnorm", "rope")
    model = GPT(cfg).eval()
    model.load_state_dict(state)
    idx = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), _hf_logits(got.model, idx), atol=ATOL, rtol=0)
    tok, theirs = checkpoint_tokenizer(got.checkpoint, cfg), AutoTokenizer.from_pretrained(str(got.directory))
    text = "hello world of tokens"
    assert tok.encode_text(text) == theirs(text)["input_ids"] and tok.eot_token == "</s>"


def test_llama3_scaling_and_gqa_are_read_from_the_old_config_form(root: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cfg = read_header(imported(root, "llama3-gqa", capsys).checkpoint).config
    assert (cfg.n_head, cfg.n_kv, cfg.d_head, cfg.tied, cfg.rope_theta) == (8, 2, 16, False, 500000.0)
    assert cfg.rope_scaling is not None and (cfg.rope_scaling.factor, cfg.rope_scaling.original_context) == (8.0, 64)
    qwen = read_header(imported(root, "qwen2", capsys).checkpoint).config
    assert (qwen.attention_bias, qwen.attention_out_bias, qwen.mlp_bias, qwen.tied) == (True, False, False, True)


def _tp_run(rank: int, world: int, file: str, idx: torch.Tensor, prompts: list[list[int]], new: int) -> dict[str, Any]:
    from hpcdist.infer.generate import Sampling, generate
    from hpcdist.infer.shard_load import kv_layout, read_shard, shard_state
    from hpcdist.infer.tp import TPGPT, TPGroup
    from hpcdist.model.checkpoint import read_full

    header = read_header(file)
    model = TPGPT(header.config, TPGroup(rank, world, None))
    shard = read_shard(header, rank, world, rank, world).state
    in_memory = shard_state(read_full(header), header.config, rank, world)  # what load: broadcast slices
    assert all((shard[k] == in_memory[k]).all() for k in in_memory)
    model.load_shard(shard)
    cache = model.new_cache(idx.shape[0], idx.shape[1])
    stepped = torch.cat([model(idx[:, :7], cache=cache)] + [model(idx[:, t : t + 1], cache=cache)
                                                             for t in range(7, idx.shape[1])], dim=1)
    out = generate(model, prompts, Sampling(max_new_tokens=new, end_token=1))
    return {"logits": model(idx), "cached": stepped, "tokens": out.tokens, "kv_heads": cache.kv[0].shape[2],
            "layout": kv_layout(header.config, world)}


PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [250, 8], [12, 13, 14, 15, 16]]  # ragged, left-padded in one batch


@pytest.mark.parametrize(("variant", "tp"), [("llama3-gqa", 1), ("llama3-gqa", 2), ("llama3-gqa", 4),
                                              ("qwen2", 2), ("mistral", 4)])
def test_tensor_parallel_logits_and_greedy_tokens_equal_transformers(
    root: Path, capsys: pytest.CaptureFixture[str], variant: str, tp: int
) -> None:
    from hpcdist.infer.hf import hf_generate_greedy

    got = imported(root, variant, capsys)
    idx = _ids(14)
    want = _hf_logits(got.model, idx)
    theirs = hf_generate_greedy(got.model, PROMPTS, 12, end_token=1)
    outs = run_ranks(tp, _tp_run, str(got.checkpoint), idx, PROMPTS, 12)
    n_kv = read_header(got.checkpoint).config.n_kv
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out["logits"], want, atol=ATOL, rtol=0, msg=f"rank {rank}")
        torch.testing.assert_close(out["cached"], want, atol=ATOL, rtol=0, msg=f"KV cache, rank {rank}")
        assert out["tokens"] == theirs, f"rank {rank}"
        assert out["kv_heads"] == max(1, n_kv // tp)  # the cache holds this rank's KV heads only
    assert ("replicated" in outs[0]["layout"]) == (tp > n_kv)


def test_export_loads_with_from_pretrained_with_equal_logits(root: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    idx = _ids()
    for variant in ("llama3-gqa", "qwen2", "llama-bias"):
        got = imported(root, variant, capsys)
        out = tmp_path / variant
        code, _, err = cli(capsys, "model", "export", str(got.checkpoint), "-o", str(out))
        assert code == 0, err
        back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        assert type(back).__name__ == type(got.model).__name__
        torch.testing.assert_close(_hf_logits(back, idx), _hf_logits(got.model, idx), atol=ATOL, rtol=0)
        tok = AutoTokenizer.from_pretrained(str(out))
        assert tok.chat_template == TEMPLATE and tok.eos_token == "</s>"
        assert tok("some words")["input_ids"] == AutoTokenizer.from_pretrained(str(got.directory))("some words")[
            "input_ids"]


def test_named_chat_templates_travel_from_import_to_export(root: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """transformers 5's form: chat_template.jinja and additional_chat_templates/tool_use.jinja."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "named"
    shutil.copytree(imported(root, "qwen2", capsys).directory, folder)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOLS)
    code, _, err = cli(capsys, "model", "import", str(folder), "-o", str(tmp_path / "named.h5"))
    assert code == 0, err
    assert checkpoint_chat_template(tmp_path / "named.h5") == {"default": TEMPLATE, "tool_use": TOOLS}
    code, _, err = cli(capsys, "model", "export", str(tmp_path / "named.h5"), "-o", str(tmp_path / "out"))
    assert code == 0, err
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).chat_template == {"default": TEMPLATE,
                                                                                   "tool_use": TOOLS}


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope"])
def test_other_rope_types_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  rope_type: str) -> None:
    from transformers import LlamaConfig

    folder = tmp_path / "hf"
    folder.mkdir()
    params: dict[str, Any] = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=64)
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                max_position_embeddings=128, rope_parameters=params).save_pretrained(str(folder))
    code, _, err = cli(capsys, "model", "import", str(folder), "-o", str(tmp_path / "x.h5"))
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert f"rope_type '{rope_type}' is not supported (supported: default, llama3)" in err


def test_other_architectures_are_refused_in_one_line(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    code, _, err = cli(capsys, "model", "import", str(folder), "-o", str(tmp_path / "x.h5"))
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "GemmaForCausalLM is not supported; supported: GPT2LMHeadModel, LlamaForCausalLM, " \
           "MistralForCausalLM, Qwen2ForCausalLM" in err


def test_a_sentencepiece_only_folder_is_converted_else_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral with Llama 2's kind of tokenizer.model and no tokenizer.json: the sentencepiece extra converts it
    (ids as SentencePiece's own, the BOS its tokenizer_config.json asks for); a file SentencePiece cannot read,
    or no sentencepiece installed, is one line."""
    import sys

    import sentencepiece

    from hpcdist.data.tokenizer import SPM_PROBE

    spm = tmp_path / "spm"
    make_llama(spm, "mistral")
    (spm / "tokenizer.json").unlink()
    sentencepiece.SentencePieceTrainer.train(
        input=str(write_corpus(tmp_path / "corpus.txt", words=3000)), model_prefix=str(tmp_path / "sp"),
        vocab_size=VOCAB, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (spm / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    (spm / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False,
         "chat_template": [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": TOOLS}]}))
    (spm / "chat_template.jinja").unlink()  # named templates in tokenizer_config.json, as transformers 4.4x kept them
    code, text, err = cli(capsys, "model", "import", str(spm), "-o", str(tmp_path / "y.h5"))
    assert code == 0, err
    assert "chat template" in text
    cfg = read_header(tmp_path / "y.h5").config
    tok = checkpoint_tokenizer(tmp_path / "y.h5", cfg)
    want = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model")).encode(SPM_PROBE)
    assert tok.encode_text(SPM_PROBE) == [1, *want] and tok.eot_token == "</s>"
    assert checkpoint_chat_template(tmp_path / "y.h5") == {"default": TEMPLATE, "tool_use": TOOLS}
    (spm / "tokenizer.model").write_bytes(b"\x0a\x00")  # not a SentencePiece model
    code, _, err = cli(capsys, "model", "import", str(spm), "-o", str(tmp_path / "z.h5"))
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "tokenizer.model cannot be converted as a SentencePiece model" in err
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as where the extra is not installed
    code, _, err = cli(capsys, "model", "import", str(spm), "-o", str(tmp_path / "z.h5"))
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "has only a SentencePiece tokenizer.model; install the sentencepiece extra" in err


def test_tp_degree_that_neither_divides_nor_is_a_multiple_of_the_kv_heads_is_refused() -> None:
    from hpcdist.infer.shard_load import check_tp
    from hpcdist.infer.tp import TPGPT, TPGroup
    from hpcdist.model.config import GPTConfig

    cfg = GPTConfig(vocab_size=64, n_head=12, n_kv_head=3, d_model=96, positions="rope", norm="rmsnorm",
                    mlp="swiglu", family="llama")
    assert check_tp(cfg, 3) == [] and check_tp(cfg, 6) == [] and check_tp(cfg, 12) == []
    (what, value, todo), = check_tp(cfg, 2)
    assert (what, value) == ("tp", 2) and "n_kv_head=3 or be a multiple of it" in todo
    with pytest.raises(ConfigError, match="tp=4 must divide the model's n_kv_head=3"):
        TPGPT(cfg, TPGroup(0, 4, None))


def test_a_sequence_longer_than_the_sliding_window_is_refused(root: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from hpcdist.infer.generate import Sampling, generate
    from hpcdist.infer.tp import TPGPT

    header = read_header(imported(root, "mistral", capsys).checkpoint)
    assert header.config.sliding_window == 48
    cfg, state = load_model_state(header.path)
    model = GPT(cfg).eval()
    model.load_state_dict(state)
    with pytest.raises(ConfigError, match="49 tokens is longer than the model's sliding_window of 48"):
        model(torch.zeros(1, 49, dtype=torch.long))
    tp = TPGPT(cfg)
    tp.load_shard(state)
    with pytest.raises(ConfigError, match="sliding_window of 48"):
        generate(tp, [[5] * 40], Sampling(max_new_tokens=10))
    assert len(generate(tp, [[5] * 40], Sampling(max_new_tokens=9)).tokens[0]) == 9  # 48 tokens in all: fine


def test_infer_gpt_job_generates_transformers_tokens_from_an_imported_llama(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The existing inference kind on the local site, tp 2 over the GQA model, each rank reading its shard."""
    import subprocess
    import sys

    import h5py

    from hpcdist.infer.hf import hf_generate_greedy

    got = imported(root, "llama3-gqa", capsys)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe cluster runs jobs\nab\n")
    repo = Path(__file__).resolve().parents[1]
    sets = [f"--set=site.storage.{k}={tmp_path / k}" for k in ("results", "checkpoints", "scratch", "logs")]
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdist.cli", "submit", str(repo / "jobs" / "infer_gpt.yaml"), "--site", "local",
         "--wait", *sets, f"--set=params.prompts={prompts}", f"--set=params.checkpoint={got.checkpoint}",
         "--set=params.load=shard", "--set=params.max_new_tokens=10"],
        cwd=repo, env={**__import__("os").environ, "PYTHONPATH": str(repo)}, text=True, capture_output=True,
        timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = (tmp_path / "results" / "infer_gpt").glob("*.h5")
    with h5py.File(path, "r") as f:
        asked = [list(map(int, p)) for p in f["tokens/prompt_ids"]]
        outputs = [list(map(int, o)) for o in f["tokens/output_ids"]]
    assert outputs == hf_generate_greedy(got.model, asked, 10, end_token=1)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").rglob("*") if p.is_file())
    assert "1 KV head(s) per rank, KV heads split" in logs


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_finetune_an_imported_llama_then_export_gives_transformers_the_same_logits(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], parallel: str
) -> None:
    """train_gpt from params.init (2 ranks, DDP or FSDP2, on the local site) moves the weights; the export of
    its last checkpoint (under FSDP a sharded one) loads in transformers with hpcdist's logits. A rotary model
    may train on a shorter context."""
    from transformers import AutoModelForCausalLM

    from hpcdist.store.sharded import checkpoint as sharded
    from tests.support.cli import run_cli, storage_sets

    def model_arrays(path: Path) -> dict[str, Any]:
        return {k: v.numpy() for k, v in load_model_state(path)[1].items()}

    got = imported(root, "llama3-gqa", capsys)
    tokens = tmp_path / "tokens.h5"
    made = run_cli("data", "prepare", str(write_corpus(tmp_path / "corpus.txt", words=4000)), "-o", str(tokens),
                   "--tokenizer", str(got.checkpoint))
    assert made.code == 0, made.text
    run = run_cli("submit", "jobs/finetune_gpt.yaml", "--site", "local", "--wait", *storage_sets(tmp_path),
                  "--set", f"params.init={got.checkpoint}", "--set", f"params.data={tokens}",
                  "--set", "params.model.context=32", "--set", "params.steps=3", "--set", "params.batch.accum=1",
                  "--set", "params.optim.lr=1e-3", "--set", "params.optim.warmup_steps=0", "--set",
                  "params.eval.every=0", "--set", "params.checkpoint.every=3", "--set", "timeout_s=120",
                  "--set", f"params.parallel={parallel}", timeout=300)
    assert run.code == 0, run.text
    last = tmp_path / "checkpoints" / "finetune_gpt" / "step_00000003.h5"
    assert sharded.shards_dir(last.parent, 3).is_dir() == (parallel == "fsdp")
    before, after = model_arrays(got.checkpoint), model_arrays(last)
    assert set(before) == set(after) and "lm_head.weight" in after  # the untied head trained as itself
    assert all(float(abs(after[k] - before[k]).max()) > 0 for k in ("lm_head.weight", "transformer.wte.weight"))
    out = tmp_path / "export"
    code, _, err = cli(capsys, "model", "export", str(last), "-o", str(out))
    assert code == 0, err
    cfg, state = load_model_state(last)
    ours = GPT(cfg).eval()
    ours.load_state_dict(state)
    idx = _ids(16)
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(AutoModelForCausalLM.from_pretrained(str(out)).eval(), idx),
                                   ours(idx), atol=ATOL, rtol=0)


def test_on_paper_figures_of_published_llama_sizes() -> None:
    """The shapes count the published parameters exactly; at tp 8 the 70B model's 8 KV heads are one per rank."""
    from hpcdist.infer.sizing import LLAMA_SIZES, tp_costs

    counts = {name: cfg.num_params() for name, cfg in LLAMA_SIZES.items()}
    assert counts == {"llama-2-7b": 6_738_415_616, "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496}
    c = tp_costs(LLAMA_SIZES["llama-3.1-70b"], 8)
    assert (c.all_reduces, c.all_reduce_bytes, c.kv_heads_per_rank) == (160, 8192 * 2, 1)
    assert c.kv_cache_bytes_per_token == 2 * 80 * 1 * 128 * 2  # keys and values, 80 layers, one head of 128, bf16
    assert c.all_reduce_sent_per_rank == 160 * 16384 * 2 * 7 / 8
    assert tp_costs(LLAMA_SIZES["llama-2-7b"], 4).kv_heads_per_rank == 8  # no GQA: 32 heads split 4 ways


def test_jobs_past_the_sliding_window_are_refused_before_launch(root: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """infer_gpt: a prompt plus new tokens past Mistral's window of 48; train_gpt: a context past it."""
    from hpcdist.config import load_site
    from hpcdist.kinds.registry import load_job
    from tests.support.cli import run_cli

    got = imported(root, "mistral", capsys)
    repo = Path(__file__).resolve().parents[1]
    site = load_site("local", [f"storage.{k}={tmp_path / k}" for k in ("results", "checkpoints", "scratch", "logs")])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n")
    sets = [f"params.prompts={prompts}", f"params.checkpoint={got.checkpoint}"]
    load_job(repo / "jobs" / "infer_gpt.yaml", site, [*sets, "params.max_new_tokens=30"])
    with pytest.raises(ConfigError, match=r"params.max_new_tokens: 60 .*exceeds the model's sliding_window of 48"):
        load_job(repo / "jobs" / "infer_gpt.yaml", site, [*sets, "params.max_new_tokens=60"])
    tokens = tmp_path / "tokens.h5"
    made = run_cli("data", "prepare", str(write_corpus(tmp_path / "corpus.txt", words=2000)), "-o", str(tokens),
                   "--tokenizer", str(got.checkpoint))
    assert made.code == 0, made.text
    train = [f"params.init={got.checkpoint}", f"params.data={tokens}", "params.eval.every=0"]
    with pytest.raises(ConfigError, match=r"params.model.context: 128 .*longer than the model's sliding_window of 48"):
        load_job(repo / "jobs" / "finetune_gpt.yaml", site, train)
    load_job(repo / "jobs" / "finetune_gpt.yaml", site, [*train, "params.model.context=48"])


def test_a_gpt2_checkpoint_written_before_the_family_fields_reads_as_before(tmp_path: Path) -> None:
    """Its model_config_json has none of the new keys: the defaults are GPT-2's, the tensors and logits the same."""
    import h5py

    from hpcdist.infer.tp import TPGPT
    from tests.support.infer import TINY, make_checkpoint

    file, model = make_checkpoint(tmp_path)
    old = {k: v for k, v in json.loads(TINY.model_dump_json()).items()
           if k in ("vocab_size", "context", "n_layer", "n_head", "d_model", "mlp", "mlp_ratio", "dropout", "ln_eps")}
    with h5py.File(file, "r+") as f:
        f.attrs["model_config_json"] = json.dumps(old)
    header = read_header(file, expect=TINY)
    assert header.config == TINY and (TINY.family, TINY.norm, TINY.positions, TINY.tied) == (
        "gpt2", "layernorm", "learned", True)
    tp = TPGPT(header.config)
    tp.load_shard(load_model_state(file)[1])
    idx = _ids(9) % TINY.vocab_size
    assert torch.equal(tp(idx), model(idx))

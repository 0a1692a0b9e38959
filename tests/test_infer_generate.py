"""Generation: greedy tokens equal Hugging Face GPT-2's on the same weights, ragged batches equal
prompts run alone, the KV cache equals recomputation, sampling is seeded, the end token stops."""

from __future__ import annotations

import pytest
import torch

from hpcdist.data.tokenizer import BYTES
from hpcdist.infer.generate import Sampling, generate, sample
from hpcdist.infer.tp import TPGPT
from hpcdist.model.gpt import GPT, GPTConfig
from tests.support.cli import require_module
from tests.support.infer import TINY, make_model

PROMPTS = [BYTES.encode_text(t) for t in ("hello world", "hi", "the quick brown fox jumps", "a")]


def _tp1(model: GPT) -> TPGPT:
    tp = TPGPT(model.cfg)
    tp.load_shard({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    return tp


def _greedy_no_cache(model: GPT, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_equals_transformers_gpt2_on_a_ragged_batch() -> None:
    require_module("transformers")
    from hpcdist.infer.hf import hf_generate_greedy
    from hpcdist.model.hf import to_hf

    cfg = GPTConfig(vocab_size=257, context=64, n_layer=2, n_head=4, d_model=64)
    model = make_model(cfg, seed=3, scale=8.0)  # spread logits: no near-ties for float order to flip
    ours = generate(_tp1(model), PROMPTS, Sampling(max_new_tokens=24, end_token=256)).tokens
    theirs = hf_generate_greedy(to_hf(cfg, model.state_dict()), PROMPTS, 24, 256)
    assert ours == theirs
    assert len({tuple(t) for t in ours}) > 1  # not a degenerate constant output


def test_kv_cache_generation_equals_recomputing_every_step() -> None:
    model = make_model(TINY, seed=1, scale=6.0)
    out = generate(_tp1(model), PROMPTS, Sampling(max_new_tokens=12))
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert tokens == _greedy_no_cache(model, prompt, 12)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_ragged_batch_equals_each_prompt_alone(mlp: str) -> None:
    model = _tp1(make_model(TINY.model_copy(update={"mlp": mlp}), seed=2, scale=6.0))
    batched = generate(model, PROMPTS, Sampling(max_new_tokens=10)).tokens
    alone = [generate(model, [p], Sampling(max_new_tokens=10)).tokens[0] for p in PROMPTS]
    assert batched == alone


def test_end_token_stops_a_row_and_max_new_tokens_bounds_the_rest() -> None:
    model = _tp1(make_model(TINY, seed=1, scale=6.0))
    free = generate(model, PROMPTS, Sampling(max_new_tokens=8)).tokens
    end = free[0][2]  # make the third token of row 0 the end token
    out = generate(model, PROMPTS, Sampling(max_new_tokens=8, end_token=end))
    assert out.tokens[0] == free[0][:3] and out.finish[0] == "end"
    for tokens, finish, ref in zip(out.tokens, out.finish, free, strict=True):
        assert len(tokens) <= 8
        assert finish == ("end" if end in ref else "length")
        assert tokens == (ref[: ref.index(end) + 1] if end in ref else ref)


def test_sampling_is_reproducible_from_its_seed_and_differs_between_seeds() -> None:
    model = _tp1(make_model(TINY, seed=1))
    s = Sampling(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95)
    a = generate(model, PROMPTS, s, torch.Generator().manual_seed(5)).tokens
    b = generate(model, PROMPTS, s, torch.Generator().manual_seed(5)).tokens
    c = generate(model, PROMPTS, s, torch.Generator().manual_seed(6)).tokens
    assert a == b and a != c


def test_top_k_and_top_p_restrict_the_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).repeat(200, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample(logits, Sampling(temperature=1.0, top_k=1), gen).tolist()) == {1}
    assert set(sample(logits, Sampling(temperature=1.0, top_k=2), gen).tolist()) == {1, 2}
    # p(1) ~ 0.46, p(2) ~ 0.42: top_p 0.5 keeps both, top_p 0.3 only the most likely
    assert set(sample(logits, Sampling(temperature=1.0, top_p=0.5), gen).tolist()) == {1, 2}
    assert set(sample(logits, Sampling(temperature=1.0, top_p=0.3), gen).tolist()) == {1}
    assert sample(logits[:1], Sampling(temperature=0.0), None).tolist() == [1]


def test_prompt_plus_new_tokens_beyond_the_context_is_refused() -> None:
    model = _tp1(make_model(TINY))
    with pytest.raises(ValueError, match="exceeds the context 64"):
        generate(model, [[1] * 60], Sampling(max_new_tokens=6))


def test_byte_tokens_round_trip() -> None:
    text = "héllo, wörld ✓"
    assert BYTES.decode(BYTES.encode_text(text)) == text
    assert BYTES.decode(BYTES.encode_text("ab") + [256]) == "ab"

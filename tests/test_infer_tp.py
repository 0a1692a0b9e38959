"""Tensor parallelism: sharded logits equal the unsharded model's, both loading paths agree,
and the broadcast delivers the source weights bit for bit. Ranks are real gloo processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist.errors import ConfigError
from hpcdist.infer.shard_load import check_tp, read_shard, shard_state
from hpcdist.infer.tp import TPGPT, TPGroup
from hpcdist.model.checkpoint import read_full, read_header
from hpcdist.model.gpt import GPT
from tests.support.infer import TINY, make_checkpoint, run_ranks

# float32 sums in a different order (partial products, then all-reduce): a few ulps of the logits.
ATOL = 1e-5


def _tp_logits(rank: int, world: int, file: str, idx: torch.Tensor, how: str) -> dict[str, Any]:
    import torch.distributed as dist

    header = read_header(file)
    tp = TPGroup(rank, world, None)
    if how == "shard":
        state: dict[str, Any] = read_shard(header, rank, world, rank, world).state
    else:
        from hpcdist.infer.broadcast import broadcast_state

        src = read_full(header) if rank == 0 else None
        full, _ = broadcast_state(src, torch.device("cpu"), bucket_bytes=1 << 14)
        state = shard_state(full, header.config, rank, world)
    model = TPGPT(header.config, tp)
    model.load_shard(state)
    logits = model(idx)
    cache = model.new_cache(idx.shape[0], idx.shape[1])
    stepped = torch.cat([model(idx[:, :5], cache=cache)] + [model(idx[:, t : t + 1], cache=cache)
                                                             for t in range(5, idx.shape[1])], dim=1)
    dist.barrier()
    return {"logits": logits, "cached": stepped}


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_logits_equal_unsharded(tmp_path: Path, tp: int, mlp: str) -> None:
    cfg = TINY.model_copy(update={"mlp": mlp})
    file, model = make_checkpoint(tmp_path, cfg, seed=tp)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    want = model(idx)
    for how in ("shard", "broadcast"):
        outs = run_ranks(tp, _tp_logits, str(file), idx, how)
        for rank, out in enumerate(outs):
            assert out["logits"].shape == want.shape
            torch.testing.assert_close(out["logits"], want, atol=ATOL, rtol=0, msg=f"{how} rank {rank}")
            torch.testing.assert_close(out["cached"], want, atol=ATOL, rtol=0, msg=f"{how} KV cache rank {rank}")
        # every rank of the group holds the same logits, so they sample the same tokens
        assert all(torch.equal(o["logits"], outs[0]["logits"]) for o in outs)


def _received(rank: int, world: int, file: str, bucket_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
    from hpcdist.infer.broadcast import broadcast_state

    header = read_header(file)
    src = read_full(header) if rank == 0 else None
    full, stats = broadcast_state(src, torch.device("cpu"), bucket_bytes=bucket_bytes)
    return {k: v.clone() for k, v in full.items()}, stats.buckets


@pytest.mark.parametrize("bucket_bytes", [0, 20_000, 64 << 20])
def test_broadcast_gives_every_rank_the_source_weights(tmp_path: Path, bucket_bytes: int) -> None:
    file, model = make_checkpoint(tmp_path)
    source = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    outs = run_ranks(3, _received, str(file), bucket_bytes)
    for rank, (got, buckets) in enumerate(outs):
        assert list(got) == list(source)
        for key, value in source.items():
            assert torch.equal(got[key], value), f"rank {rank} {key}"
        if bucket_bytes == 0:
            assert buckets == len(source)  # tensor by tensor
        elif bucket_bytes == 64 << 20:
            assert buckets == 1


def test_broadcast_and_shard_reads_give_identical_shards(tmp_path: Path) -> None:
    file, _ = make_checkpoint(tmp_path, TINY.model_copy(update={"mlp": "swiglu"}))
    header = read_header(file)
    full = read_full(header)
    for r in range(2):
        via_file = read_shard(header, r, 2, r, 2).state
        via_memory = shard_state(full, header.config, r, 2)
        assert all((via_file[k] == via_memory[k]).all() for k in full)
        assert via_file["transformer.h.0.attn.c_attn.weight"].shape == (3 * 16, 32)
        assert via_file["transformer.h.0.mlp.c_fc.weight"].shape == (2 * 64, 32)
        assert via_file["transformer.h.0.mlp.c_proj.weight"].shape == (32, 64)


def test_tp_degree_must_divide_heads_and_hidden_size() -> None:
    assert check_tp(TINY, 3)[0][2].startswith("must divide the model's n_head=4")
    odd_hidden = TINY.model_copy(update={"d_model": 8, "mlp_ratio": 0.75})  # d_hidden 6
    assert "hidden size 6" in check_tp(odd_hidden, 4)[0][2]
    assert check_tp(TINY, 4) == []
    with pytest.raises(ConfigError, match="n_head"):
        TPGPT(TINY, TPGroup(0, 3, None))


def test_tp1_model_is_the_plain_gpt() -> None:
    model = GPT(TINY).eval()
    tp = TPGPT(TINY)
    tp.load_shard({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    idx = torch.randint(0, 257, (3, 9))
    assert torch.equal(tp(idx), model(idx))


def test_broadcast_job_figures_follow_the_factor_table_at_4_ranks() -> None:
    from hpcdist.bench.bandwidth import bus_factor
    from hpcdist.infer.broadcast import iteration_figures

    nbytes = 3_000_000_000
    # rank_times[rank][iteration]: iteration 0 averages 1.5 s over the 4 ranks, iteration 1 2.0 s
    rank_times = [[1.0, 2.0], [1.0, 2.0], [3.0, 2.0], [1.0, 2.0]]
    fig = iteration_figures(nbytes, rank_times)
    assert fig.times == [1.5, 2.0]
    assert fig.algbw_gbps == pytest.approx([2.0, 1.5])  # 3e9 B / 1e9 / s
    assert bus_factor("broadcast", 4) == 1.0
    assert fig.busbw_gbps == pytest.approx([2.0, 1.5])
    assert fig.busbw_median_gbps == pytest.approx(1.75)


def _stats(rank: int, world: int) -> Any:
    from hpcdist.infer.broadcast import broadcast_state

    src = {"a": torch.ones(1000), "b": torch.ones(24, 10, dtype=torch.float64)} if rank == 0 else None
    _, stats = broadcast_state(src, torch.device("cpu"), bucket_bytes=1 << 20)
    return stats


def test_broadcast_stats_at_4_ranks_use_the_factor_table() -> None:
    from hpcdist.bench.bandwidth import busbw

    for stats in run_ranks(4, _stats):
        assert stats.bytes == 1000 * 4 + 240 * 8 and stats.ranks == 4 and stats.seconds > 0
        assert stats.busbw_gbps == busbw("broadcast", stats.bytes, stats.seconds, 4)
        assert stats.busbw_gbps == pytest.approx(stats.bytes / 1e9 / stats.seconds)
        assert stats.as_dict()["algbw_gbps"] == stats.algbw_gbps

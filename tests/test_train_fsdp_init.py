"""FSDP2's model set-up (``hpcdist.train.parallel.build``) on CPU with gloo, real processes: each
rank makes only its shard, from the meta device, and the shards are the weights one process's
``GPT(cfg)`` has for the same seed (GPT-2 shaped with its tied head, and LLaMA shaped), at 2 and 3
ranks; a rank's peak memory while building is about its share of a 300 MB model."""

from __future__ import annotations

import logging
import re
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpcdist.model.gpt import GPT, GPTConfig
from hpcdist.train import parallel
from hpcdist.train.params import ParallelParams
from tests.support.rankctx import rank_context

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

GPT2 = GPTConfig(vocab_size=61, context=16, n_layer=2, n_head=2, d_model=16)
LLAMA = GPTConfig(vocab_size=67, context=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, positions="rope",
                  norm="rmsnorm", mlp="swiglu", tied=False, attention_bias=False, attention_out_bias=False,
                  mlp_bias=False)
# 6 blocks of 12.6M parameters and a 4M embedding: 320 MB in float32, its largest parameter 16.8 MB
BIG = GPTConfig(vocab_size=4096, context=32, n_layer=6, n_head=8, d_model=1024)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank(r: int, world: int, port: int, root: Path, cfg: GPTConfig, out: dict[str, object]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        job = rank_context(root, rank=r, world=world).job
        torch.manual_seed(5)
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda rec: lines.append(rec.getMessage())  # type: ignore[method-assign]
        log = logging.getLogger("hpcdist")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        fsdp = ParallelParams.model_validate("fsdp")
        if cfg == BIG:  # torch's first use of meta tensors, FSDP and DTensor (80 MB of code and imports) first
            parallel.build(GPT2, job, fsdp, "fp32")
            lines.clear()
        model, _ = parallel.build(cfg, job, fsdp, "fp32")
        log.removeHandler(handler)
        out[f"log{r}"] = [s for s in lines if "model set-up" in s]
        if cfg != BIG:
            whole = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
            tied = model.lm_head.weight is model.transformer["wte"].weight
            x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
            logits = model(x).detach()
            if r == 0:
                out.update(whole=whole, tied=tied, logits=logits)
        dist.barrier()  # FSDP's last gathers done on every rank before the group goes (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()


def build_sharded(tmp_path: Path, world: int, cfg: GPTConfig) -> dict[str, object]:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank, args=(world, free_port(), tmp_path, cfg, out), nprocs=world)
        return dict(out)


@pytest.mark.parametrize(("cfg", "world"), [(GPT2, 2), (LLAMA, 3)], ids=["gpt2-tied-2-ranks", "llama-3-ranks"])
def test_the_shards_are_the_unsharded_models_weights(tmp_path: Path, cfg: GPTConfig, world: int) -> None:
    got = build_sharded(tmp_path, world, cfg)
    torch.manual_seed(5)
    one = GPT(cfg).eval()
    assert got["tied"] is cfg.tied
    expected = dict(one.named_parameters())
    whole = got["whole"]
    assert isinstance(whole, dict) and sorted(whole) == sorted(expected)
    assert [n for n in expected if not torch.equal(whole[n], expected[n].detach())] == []
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(got["logits"], one(x).detach(), atol=1e-5)  # type: ignore[arg-type]


def test_a_ranks_set_up_memory_is_its_share(tmp_path: Path) -> None:
    """Each rank's log says what it holds and how much its peak memory (Linux's VmHWM, reset when the
    build starts; it sees torch's allocations) grew while building: its half, plus one whole
    parameter at a time (after a first, small build); building the whole model first (the old way)
    grows it by 319 MB."""
    got = build_sharded(tmp_path, 2, BIG)
    for r in (0, 1):
        (line,) = got[f"log{r}"]  # type: ignore[misc]
        held, whole, grew = map(float, re.findall(r"([\d.]+) MB", line))
        assert whole == pytest.approx(BIG.num_params() * 4 / 1e6, abs=0.1)
        assert held == pytest.approx(whole / 2, rel=0.01)
        assert held <= grew < (held + whole) / 2, line

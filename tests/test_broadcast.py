"""`broadcast_state`: every rank ends with rank 0's exact bytes (sha256), whether rank 0 packs
separate tensors of mixed dtypes, sends them from their own storage, sends a state already laid
out in the flat buffer, or the buffer is reused across calls; receivers get views of one buffer
(no per-tensor allocation), and rank 0 copies nothing it can send as it lies."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from tests.support.infer import run_ranks


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(33, 17, generator=g),
        "b": torch.randn(5, generator=g).to(torch.float16),
        "steps": torch.arange(3, dtype=torch.int64),
        "t": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "half": torch.randn(9, generator=g).to(torch.bfloat16),
    }


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in state.items()}


def _rank(rank: int, world: int, bucket: int) -> dict[str, Any]:
    from hpcdist.infer.broadcast import broadcast_state, describe, flat_buffer, in_buffer

    cpu = torch.device("cpu")
    src = _source() if rank == 0 else None
    got, stats = broadcast_state(src, cpu, bucket_bytes=bucket)  # meta by object broadcast, fresh buffer
    first = _digests(got)
    bases = {v.untyped_storage().data_ptr() for v in got.values()}
    own = sorted(k for k, v in got.items() if src is not None and v.data_ptr() == src[k].data_ptr())
    meta = describe(_source())
    buffer = flat_buffer(meta, cpu)
    placed = in_buffer(src, meta, buffer) if src is not None else None
    again = []
    for _ in range(2):  # reused buffer, rank 0's state already in it: nothing to pack
        out, _ = broadcast_state(placed, cpu, bucket_bytes=bucket, meta=meta, buffer=buffer)
        again.append(_digests(out))
        assert all(v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for v in out.values())
    return {"first": first, "again": again, "bases": len(bases), "own": own, "buckets": stats.buckets,
            "bytes": stats.bytes}


@pytest.mark.parametrize("bucket", [0, 300, 64 << 20])
def test_every_rank_receives_rank_zeros_bytes(bucket: int) -> None:
    want = _digests(_source())
    outs = run_ranks(3, _rank, bucket)
    for rank, out in enumerate(outs):
        assert out["first"] == want, f"rank {rank}"
        assert out["again"] == [want, want], f"rank {rank}"
        if rank or bucket == 64 << 20:
            assert out["bases"] == 1  # views of one buffer (rank 0: of its one packed bucket)
        assert out["bytes"] == sum(v.numel() * v.element_size() for v in _source().values())
    assert outs[0]["buckets"] == {0: 5, 64 << 20: 1}.get(bucket, outs[0]["buckets"])
    assert bucket != 300 or 1 < outs[0]["buckets"] < 5
    # a contiguous tensor alone in its bucket goes from rank 0's own storage: no copy
    assert outs[0]["own"] == {0: ["b", "half", "steps", "w"], 300: ["w"], 64 << 20: []}[bucket]


def _big(rank: int, world: int) -> dict[str, Any]:
    from hpcdist.infer.broadcast import DIRECT_BYTES, broadcast_state, describe, flat_buffer, in_buffer

    cpu = torch.device("cpu")
    src = _big_source(DIRECT_BYTES) if rank == 0 else None
    got, stats = broadcast_state(src, cpu)
    own = sorted(k for k, v in got.items() if src is not None and v.data_ptr() == src[k].data_ptr())
    meta = describe(_big_source(DIRECT_BYTES))
    buffer = flat_buffer(meta, cpu)
    placed, placed_stats = broadcast_state(in_buffer(src, meta, buffer) if src is not None else None, cpu,
                                           meta=meta, buffer=buffer)
    return {"digests": _digests(got), "own": own, "buckets": stats.buckets, "placed": _digests(placed),
            "placed_buckets": placed_stats.buckets}


def _big_source(direct_bytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(7, generator=g), "big": torch.randn(direct_bytes // 4 + 1, generator=g),
            "b": torch.randn(3, generator=g), "c": torch.randn(5, 2, generator=g)}


def test_a_big_tensor_goes_alone_from_rank_zeros_storage() -> None:
    from hpcdist.infer.broadcast import DIRECT_BYTES

    want = _digests(_big_source(DIRECT_BYTES))
    outs = run_ranks(2, _big)
    assert [o["digests"] for o in outs] == [want, want]
    assert outs[0]["own"] == ["big"]  # alone in its bucket, sent as it lies
    assert outs[0]["buckets"] == 2  # [big] [c, a, b]: the small ones together, `a` (before `big`) too
    # already laid out in the flat buffer, the big tensor shares the one bucket: nothing to copy either way
    assert [o["placed"] for o in outs] == [want, want]
    assert [o["placed_buckets"] for o in outs] == [1, 1]


def _layers(n: int) -> dict[str, torch.Tensor]:
    """A model's shape in small: per layer a weight just over the direct size and two small tensors."""
    from hpcdist.infer.broadcast import DIRECT_BYTES

    g = torch.Generator().manual_seed(5)
    out = {}
    for i in range(n):
        out[f"ln{i}"] = torch.randn(64, generator=g)
        out[f"w{i}"] = torch.randn(DIRECT_BYTES // 4 + 64, generator=g)
        out[f"b{i}"] = torch.randn(64, generator=g)
    return out


def _layered(rank: int, world: int) -> dict[str, Any]:
    from hpcdist.infer.broadcast import broadcast_state

    src = _layers(4) if rank == 0 else None
    got, stats = broadcast_state(src, torch.device("cpu"))  # a fresh buffer, one 64 MB bucket at most
    own = sorted(k for k, v in got.items() if src is not None and v.data_ptr() == src[k].data_ptr())
    return {"digests": _digests(got), "own": own, "buckets": stats.buckets}


def test_a_layered_state_goes_in_one_broadcast_per_big_tensor_and_one_for_the_rest() -> None:
    """Each collective costs rank 0 about what copying 1 MB does (gloo here): the 1 MiB weights go
    as they lie and the eight small tensors, one between each pair of weights, in one bucket."""
    want = _digests(_layers(4))
    outs = run_ranks(2, _layered)
    assert [o["digests"] for o in outs] == [want, want]
    assert outs[0]["own"] == ["w0", "w1", "w2", "w3"]  # nothing of the weights copied on rank 0
    assert outs[0]["buckets"] == 5

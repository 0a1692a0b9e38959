"""Plain data between ranks (``hpcdist.runtime.plain``): what one rank sends comes back as it went
on the others, and bytes that are not hpcdist's JSON (a pickle planted by a process on the job's
store or ports) are refused on the receiver without being run. Two real gloo ranks, forked."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpcdist.runtime import plain
from tests.support.infer import run_ranks


def _values() -> dict[str, Any]:
    """One value of each kind a call site sends (a rank's RNG tree among them), rank 0's or rank 1's."""
    from hpcdist.train import state as st

    return {
        "nested": {"a": [1, 2.5, None, True, "x"], "b": {"c": {"d": []}}, "inf": -math.inf},
        "tuples": [("w", (3, 4), "float32"), ((), "")],  # infer's Meta: a list of tuples
        "keys": {1: "one", "$tag": "escaped", (2, 3): None},
        "bytes": b"\x00\x80pickle?\xff",
        "arrays": [np.arange(6, dtype=np.uint32).reshape(2, 3), np.float64(0.25), np.int64(-3), np.zeros(0)],
        "tensors": [torch.arange(4, dtype=torch.bfloat16), torch.tensor(7.5), torch.tensor([True, False]),
                    torch.empty(0, 3)],
        "rng": st.rng_tree(torch.device("cpu")),
    }


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same type all the way down (a tuple is not a list, 1 is not True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


def _round_trips(rank: int, world: int) -> list[Any]:
    mine = {"rank": rank, **_values()}
    everyone = plain.all_gather_plain(mine)
    first = plain.broadcast_plain(mine if rank == 1 else None, src=1)
    gathered = plain.gather_plain(mine, dst=0)
    try:
        plain.all_gather_plain(Path("/x") if rank == 1 else 1, what="a path")
        refused = ""
    except plain.DataError as exc:
        refused = str(exc)
    return [everyone, first, gathered, refused]


def test_each_kind_of_value_comes_back_as_it_went_on_every_rank() -> None:
    got = run_ranks(2, _round_trips, timeout=60)
    assert got[1][2] is None and len(got[0][2]) == 2
    assert _same(got[0][2][1], got[1][1]) and _same(got[0][0][0]["rng"], got[0][2][0]["rng"])
    rng = got[0][0][1]["rng"]
    assert isinstance(rng["torch_cpu"], torch.Tensor) and rng["torch_cpu"].dtype == torch.uint8
    assert isinstance(rng["numpy_keys"], np.ndarray) and rng["numpy_keys"].dtype == np.uint32
    for rank in (0, 1):
        everyone, first, gathered, refused = got[rank]
        assert _same(everyone[1], first)  # rank 1's value as rank 1 itself holds it
        assert [v["rank"] for v in everyone] == [0, 1]
        for value in everyone:
            want = {"rank": value["rank"], **_values()}
            del want["rng"], value["rng"]  # each rank's generators, checked below
            assert _same(value, want), value
        # the same refusal on both ranks, naming the rank, what and why
        assert refused.startswith("rank 1 cannot share a path: PosixPath PosixPath('/x') is not plain data")


class _Planted:
    """A pickle that creates `path` when it is loaded: what an attacker would send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _send(op: str, data: bytes, length: int | None = None) -> None:
    """Rank 1's side of `op`, speaking plain's tensor protocol with `data` as the message."""
    import torch.distributed as dist

    size = torch.tensor([len(data) if length is None else length], dtype=torch.int64)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if op == "broadcast":
        dist.broadcast(size, src=1)
        if length is None:
            dist.broadcast(buffer, src=1)
    elif op == "all_gather":
        sizes = [torch.zeros_like(size) for _ in range(2)]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        dist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in range(2)],
                        torch.cat([buffer, torch.zeros(longest - len(data), dtype=torch.uint8)]))
    else:  # gather to rank 0
        dist.gather(size, None, dst=0)
        longest = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(longest, src=0)
        dist.gather(torch.cat([buffer, torch.zeros(int(longest.item()) - len(data), dtype=torch.uint8)]), None, dst=0)


def _receiving_a_pickle(rank: int, world: int, target: str) -> list[str]:
    payload = pickle.dumps(_Planted(target))
    errors = []
    for op in ("broadcast", "all_gather", "gather", "oversized"):
        if rank == 1:
            _send("broadcast" if op == "oversized" else op, payload,
                  plain.MAX_BYTES + 1 if op == "oversized" else None)
            continue
        try:
            if op in ("broadcast", "oversized"):
                plain.broadcast_plain(None, src=1)
            elif op == "all_gather":
                plain.all_gather_plain({"honest": True})
            else:
                plain.gather_plain({"honest": True}, dst=0)
            errors.append(f"{op}: nothing raised")
        except plain.DataError as exc:
            errors.append(f"{op}: {exc}")
    return errors


def test_a_receiver_given_a_pickle_refuses_it_and_never_runs_it(tmp_path: Path) -> None:
    """Rank 1 answers broadcast, all_gather and gather with a pickle whose loading creates a file:
    rank 0 raises one DataError naming rank 1 each time and the file is never made."""
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Planted(str(control))))  # the payload works: loading it makes its file
    assert control.exists()
    target = tmp_path / "owned"
    errors = run_ranks(2, _receiving_a_pickle, str(target), timeout=60)[0]
    assert not target.exists()
    assert len(errors) == 4
    for line in errors[:3]:
        assert "rank 1 sent " in line and "bytes that are not plain data" in line, line
        assert "never pickles" in line and "b'\\x80" in line, line  # a pickle's first byte, shown
    assert errors[3].startswith(f"oversized: rank 1 announced a message of {plain.MAX_BYTES + 1} bytes")


@pytest.mark.parametrize("data", [b'{"value": {"$tuple": 1}}', b'{"value": {"$dict": [[[1], 2]]}}',
                                  b'{"value": {"$ndarray": {"dtype": "|O", "shape": [1], "data": ""}}}',
                                  b'{"value": {"$tensor": {"dtype": "load", "shape": [], "data": ""}}}',
                                  b'{"value": 1, "refused": "x"}', b'[1]', b'{"value": {"$eval": "1"}}'])
def test_json_that_plain_cannot_have_written_is_refused(data: bytes) -> None:
    with pytest.raises(plain.DataError, match="rank 3 sent .* bytes that are not plain data"):
        plain._values([data], [3])

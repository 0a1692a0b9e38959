"""Plain data between ranks, sent as JSON in tensors and never as a pickle.

torch's object collectives (``all_gather_object``, ``broadcast_object_list``, ``gather_object``)
pickle on the sender and unpickle on every receiver, so any process that can answer on the job's
store or gloo/NCCL ports could run code as the user. Here a value travels as UTF-8 JSON in a
uint8 tensor (its length first, as an int64 tensor) and a receiver only ever runs ``json.loads``:
bytes that are not JSON are one ``DataError`` naming the rank that sent them, never executed.

What JSON cannot spell is tagged by a one-key object that ``decode`` reverses and nothing else
can produce (a dict whose keys are not all str, or start with ``$``, travels as pairs): tuples,
bytes (base64), numpy arrays and scalars and torch tensors (dtype, shape and base64 bytes,
rebuilt with ``frombuffer``; tensors come back on the CPU). Anything else (a class of the
caller's, a ``Path``) is refused on the sender, and that refusal reaches every rank that would
have read it, so no rank waits for a value that never comes.

torch and numpy are imported on first use: the bootstrap imports this before it times torch.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

from hpcdist.errors import HpcdistError

# The most one rank accepts from another in one message: a length beyond it is refused before
# anything is allocated (what an attacker on the store can still do is fail the job, not fill
# its memory). The largest plain value hpcdist sends is a few MB (infer_gpt's requests).
MAX_BYTES = 1 << 30
KINDS = "None, bool, int, float, str, bytes, lists, tuples, dicts, numpy arrays and scalars, tensors"


class DataError(HpcdistError, ValueError):
    """A value cannot travel between ranks as plain data, or what a rank received is not it."""


def encode(value: Any) -> Any:
    """`value` as JSON-ready data; `decode` gives it back. A TypeError for what is not plain data."""
    if value is None or isinstance(value, (bool, str)):
        return value
    np = sys.modules.get("numpy")  # not imported: nothing here is a numpy value
    torch = sys.modules.get("torch")
    if np is not None and isinstance(value, np.generic):
        return {"$npscalar": _array_fields(np.asarray(value))}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"$dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if np is not None and isinstance(value, np.ndarray):
        return {"$ndarray": _array_fields(value)}
    if torch is not None and isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return {"$tensor": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                            "data": base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode("ascii")}}
    raise TypeError(f"{type(value).__name__} is not plain data")


def _array_fields(array: Any) -> dict[str, Any]:
    if array.dtype.hasobject:
        raise TypeError("a numpy array of Python objects is not plain data")
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(array.tobytes(order="C")).decode("ascii")}


def decode(data: Any) -> Any:
    """The value `encode` spelled; a ValueError for what `encode` cannot have written."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    tags = [k for k in data if k.startswith("$")]
    if not tags:
        return {k: decode(v) for k, v in data.items()}
    if len(data) != 1:
        raise ValueError(f"an object with a tag {tags[0]!r} beside other keys")
    tag, body = next(iter(data.items()))
    if tag == "$tuple" and isinstance(body, list):
        return tuple(decode(v) for v in body)
    if tag == "$dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {decode(k): decode(v) for k, v in body}
    if tag == "$bytes" and isinstance(body, str):
        return base64.b64decode(body, validate=True)
    if tag in ("$ndarray", "$npscalar") and isinstance(body, dict):
        import numpy as np

        dtype = np.dtype(str(body["dtype"]))
        if dtype.hasobject:
            raise ValueError("a numpy array of Python objects")
        array = np.frombuffer(base64.b64decode(body["data"], validate=True), dtype=dtype)
        array = array.reshape([int(n) for n in body["shape"]]).copy()
        return array[()] if tag == "$npscalar" else array
    if tag == "$tensor" and isinstance(body, dict):
        import torch

        kind = getattr(torch, str(body["dtype"]), None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"{body['dtype']!r} is not a torch dtype")
        raw = bytearray(base64.b64decode(body["data"], validate=True))
        shape = [int(n) for n in body["shape"]]
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(kind).reshape(shape)
    raise ValueError(f"an unknown tag {tag!r}")


def all_gather_plain(value: Any, group: Any = None, device: Any = None, what: str = "a value") -> list[Any]:
    """Every rank's `value`, in rank order, on every rank of `group`."""
    import torch
    import torch.distributed as dist

    where = _device(group, device)
    data = _payload(value, what, dist.get_rank(group))
    size = torch.tensor([len(data)], dtype=torch.int64, device=where)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    _check_lengths(lengths)
    longest = max(lengths)
    mine = _tensor(data, longest, where)
    buffers = [torch.empty(longest, dtype=torch.uint8, device=where) for _ in lengths]
    dist.all_gather(buffers, mine, group=group)
    return _values([_bytes(b, n) for b, n in zip(buffers, lengths, strict=True)], range(len(lengths)))


def broadcast_plain(value: Any, src: int, group: Any = None, device: Any = None, what: str = "a value") -> Any:
    """`src`'s `value` (a global rank, as torch's `src`) on every rank of `group`; the others'
    `value` is ignored. `src` gets its own object back; the others a copy decoded from JSON."""
    import torch
    import torch.distributed as dist

    where = _device(group, device)
    is_src = dist.get_rank() == src
    data = _payload(value, what, src) if is_src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=where)
    dist.broadcast(size, src=src, group=group)
    length = int(size.item())
    _check_lengths([length], first=src)
    buffer = _tensor(data, length, where) if is_src else torch.empty(length, dtype=torch.uint8, device=where)
    dist.broadcast(buffer, src=src, group=group)
    got = _values([data if is_src else _bytes(buffer, length)], [src])[0]
    return value if is_src else got


def gather_plain(value: Any, dst: int, group: Any = None, device: Any = None,
                 what: str = "a value") -> list[Any] | None:
    """Every rank's `value`, in rank order, on `dst` (a global rank); None on the others."""
    import torch
    import torch.distributed as dist

    where = _device(group, device)
    is_dst = dist.get_rank() == dst
    data = _payload(value, what, dist.get_rank(group))
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=where)
    sizes = [torch.zeros_like(size) for _ in range(world)] if is_dst else None
    dist.gather(size, sizes, dst=dst, group=group)
    # every rank learns the longest message, so each sends a buffer of the one size dst expects
    longest = torch.tensor([max(int(s.item()) for s in sizes) if sizes else 0], dtype=torch.int64, device=where)
    dist.broadcast(longest, src=dst, group=group)
    if sizes is not None:
        _check_lengths([int(s.item()) for s in sizes])
    _check_lengths([int(longest.item())], first=dst)
    mine = _tensor(data, int(longest.item()), where)
    buffers = [torch.empty_like(mine) for _ in range(world)] if is_dst else None
    dist.gather(mine, buffers, dst=dst, group=group)
    if buffers is None or sizes is None:
        _values([data], [dist.get_rank(group)])  # a refusal of this rank's own value is raised here too
        return None
    return _values([_bytes(b, int(n.item())) for b, n in zip(buffers, sizes, strict=True)], range(world))


def _payload(value: Any, what: str, rank: int) -> bytes:
    """The bytes this rank sends: its value, or why it cannot send it (which every reader raises)."""
    try:
        text = json.dumps({"value": encode(value)})
    except (TypeError, ValueError, RecursionError) as exc:
        text = json.dumps({"refused": f"rank {rank} cannot share {what}: {type(value).__name__} {value!r:.80} is "
                                      f"not plain data ({KINDS}) ({exc})"})
    return text.encode()


def _values(messages: list[bytes], ranks: Any) -> list[Any]:
    """Each message's value, after every message was read: a sender's refusal is raised here."""
    out: list[Any] = []
    refused = []
    for data, rank in zip(messages, ranks, strict=True):
        try:
            got = json.loads(data)
            if not isinstance(got, dict) or not ({"value"} == got.keys() or {"refused"} == got.keys()):
                raise ValueError("not a message of hpcdist's")
            out.append(decode(got["value"]) if "value" in got else None)
            if "refused" in got:
                refused.append(str(got["refused"]))
        except (ValueError, KeyError, TypeError, RuntimeError, RecursionError) as exc:
            raise DataError(
                f"rank {rank} sent {len(data)} bytes that are not plain data as hpcdist sends it "
                f"({type(exc).__name__}: {str(exc)[:200]}; they begin {bytes(data[:16])!r}); nothing it sent was run "
                "(ranks exchange JSON, never pickles): a process that is not one of this job's ranks may have "
                "answered on the job's store or ports") from exc
    if refused:
        raise DataError(refused[0])
    return out


def _check_lengths(lengths: list[int], first: int | None = None) -> None:
    for rank, length in enumerate(lengths):
        if not 0 < length <= MAX_BYTES:
            who = f"rank {first}" if first is not None else f"rank {rank}"
            raise DataError(f"{who} announced a message of {length} bytes (at most {MAX_BYTES} are taken): not one "
                            "hpcdist sends; a process that is not one of this job's ranks may have answered")


def _device(group: Any, device: Any) -> Any:
    """Where the group's backend takes tensors: `device` when given, else this rank's GPU for
    NCCL (as torch's object collectives choose) and the CPU for gloo and MPI."""
    import torch
    import torch.distributed as dist

    if device is not None:
        return device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tensor(data: bytes, length: int, device: Any) -> Any:
    import torch

    out = torch.zeros(length, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def _bytes(buffer: Any, length: int) -> bytes:
    return bytes(buffer[:length].cpu().numpy().tobytes())


__all__ = ["DataError", "MAX_BYTES", "all_gather_plain", "broadcast_plain", "decode", "encode", "gather_plain"]

"""Plain values in a checkpoint as data, never a pickle: JSON in, JSON out.

A sharded checkpoint keeps what is not a tensor (a sampler's position, AdamW's param_groups,
``random.getstate()``) beside its tensors. DCP pickles such values (``torch.save``) and unpickles
them in full on load (``torch.load(weights_only=False)``): a checkpoint someone else wrote would
then be code that runs. hpcdist writes them as UTF-8 JSON instead (`to_json`), with markers for
what JSON lacks: tuples, dicts with keys other than strings, non-finite floats, bytes, NumPy
arrays and scalars, small tensors, torch dtypes. Anything else is refused at the save, in one line.

A format-1 checkpoint's values are DCP's pickles: `unpickle_data` loads them as torch does with
``weights_only=True`` (tensors, numbers, strings, containers: no class is imported, no function
called) and refuses anything more in one line naming the file and the entry.
"""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any

import numpy as np

from hpcdist.errors import CheckpointError

ENCODING = "json"  # what a chunk record names (``sharded_layout.Chunk.encoding``)
_MARK = "__hpcdist__"  # {"__hpcdist__": kind, "v": ...}: a value JSON has no form for


def _mark(kind: str, value: Any) -> dict[str, Any]:
    return {_MARK: kind, "v": value}


def _array(arr: np.ndarray, where: str) -> dict[str, Any]:
    if arr.dtype.kind not in "biufc":
        raise CheckpointError(f"cannot checkpoint {where!r}: a NumPy array of dtype {arr.dtype} is not numbers; "
                              "convert it to numbers or strings first")
    data = base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": data}


def encode(value: Any, where: str = "value") -> Any:
    """`value` as JSON-ready data (`decode` reverses it); a value that is not plain data raises a
    one-line CheckpointError naming `where`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else _mark("float", repr(float(value)))
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return _mark("tuple", [encode(v, f"{where}[{i}]") for i, v in enumerate(value)])
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _MARK not in value:
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        return _mark("dict", [[encode(k, where), encode(v, f"{where}.{k}")] for k, v in value.items()])
    if isinstance(value, (bytes, bytearray)):
        return _mark("bytes", base64.b64encode(bytes(value)).decode())
    if isinstance(value, np.ndarray):
        return _mark("ndarray", _array(value, where))
    if isinstance(value, np.generic):
        return _mark("npscalar", _array(np.asarray(value), where))
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            from hpcdist.store.checkpoint.tree import tensor_array, torch_dtype_name

            t = value.detach().cpu()
            name = str(t.dtype).removeprefix("torch.")
            return _mark("tensor", {**_array(tensor_array(t), where), "torch_dtype": name,
                                    "bits": bool(torch_dtype_name(t))})
        if isinstance(value, torch.dtype):
            return _mark("torch_dtype", str(value).removeprefix("torch."))
        if isinstance(value, torch.device):
            return _mark("torch_device", str(value))
    raise CheckpointError(
        f"cannot checkpoint {where!r} ({type(value).__module__}.{type(value).__qualname__}): hpcdist stores "
        "plain values as data, never a pickle; keep numbers, strings, lists, tuples, dicts, arrays and tensors "
        "there, or convert the object first (e.g. to its state_dict)")


def _unarray(v: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(v["data"])
    return np.frombuffer(raw, dtype=np.dtype(v["dtype"])).reshape(v["shape"]).copy()


def decode(data: Any) -> Any:
    """The value `encode` made."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(_MARK)
    if kind is None:
        return {k: decode(v) for k, v in data.items()}
    v = data["v"]
    if kind == "float":
        return float(v)
    if kind == "tuple":
        return tuple(decode(x) for x in v)
    if kind == "dict":
        return {_hashable(decode(k)): decode(x) for k, x in v}
    if kind == "bytes":
        return base64.b64decode(v)
    if kind == "ndarray":
        return _unarray(v)
    if kind == "npscalar":
        return _unarray(v)[()]
    import torch

    if kind == "tensor":
        from hpcdist.store.checkpoint.tree import from_bits

        arr = _unarray(v)
        return from_bits(arr, v["torch_dtype"]).clone() if v["bits"] else torch.from_numpy(arr)
    if kind == "torch_dtype":
        return getattr(torch, v)
    if kind == "torch_device":
        return torch.device(v)
    raise CheckpointError(f"a checkpoint value of kind {kind!r} is not one this hpcdist knows; upgrade hpcdist")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def to_json(value: Any, where: str = "value") -> bytes:
    """`value` as UTF-8 JSON bytes (`encode`)."""
    return json.dumps(encode(value, where), separators=(",", ":"), allow_nan=False).encode()


def from_json(raw: bytes | memoryview | np.ndarray, where: str = "value") -> Any:
    """The value `to_json` wrote; damaged JSON is a one-line CheckpointError naming `where`."""
    try:
        text = bytes(raw).decode()
        return decode(json.loads(text))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where} is not the JSON hpcdist writes ({type(exc).__name__}: {exc}); "
                              "the file is damaged") from exc


def unpickle_data(raw: bytes | io.BytesIO, where: str) -> Any:
    """A pickled value (DCP's ``torch.save`` bytes: a format-1 checkpoint's, a DCP folder's) loaded
    as data only: ``torch.load(weights_only=True)``, which imports no class and calls no function.
    Anything more is refused in one line naming `where` (the file and the entry)."""
    import pickle

    import torch

    stream = raw if isinstance(raw, io.BytesIO) else io.BytesIO(bytes(raw))
    stream.seek(0)
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError, EOFError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        first = next((line for line in lines if "GLOBAL" in line or "WeightsUnpickler" in line), lines[0])[:160]
        raise CheckpointError(
            f"{where} is a pickle that holds more than tensors and plain values ({first}); hpcdist loads "
            "checkpoints as data and runs nothing from them: load it yourself with torch.load(weights_only=False) "
            "only if you trust whoever wrote it") from exc

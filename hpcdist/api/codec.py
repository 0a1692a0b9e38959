"""Any state <-> a checkpoint tree: what HDF5 cannot name or hold, spelled with reversible markers.

State (model and optimizer state_dicts, RNG states, nested lists and tuples, None, int keys)
becomes a ``hpcdist.store`` tree with ``encode`` and comes back with ``decode``, arrays as CPU
tensors. The same spelling carries rank 0's plain values to the other ranks as JSON
(``broadcast_data``, through ``hpcdist.runtime.plain``), never as a pickle. torch is imported
only by ``decode`` and ``broadcast_data``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint.tree import as_tensor

_NONE = "__none__"
_INT = "__int__"
_SEQ = "__seq__"


def encode(value: Any) -> Any:
    """A state as a store tree: what HDF5 cannot name or hold is spelled with markers that
    ``decode`` reverses."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CheckpointError(f"state key {key!r} is a {type(key).__name__}; use str or int keys")
            text = f"{_INT}{key}" if isinstance(key, int) else key
            if "/" in text or text in ("", ".", _SEQ):
                raise CheckpointError(f"state key {key!r} cannot name an HDF5 member; rename it")
            out[text] = encode(item)
        return out
    if isinstance(value, tuple) or (isinstance(value, list) and not _plain_list(value)):
        return {_SEQ: "tuple" if isinstance(value, tuple) else "list",
                **{str(i): encode(v) for i, v in enumerate(value)}}
    if value is None:
        return _NONE
    return value


def _plain_list(items: list[Any]) -> bool:
    """A list HDF5 keeps as one attribute: all str, or all numbers of one kind."""
    kinds = {bool if isinstance(v, bool) else int if isinstance(v, int) else float if isinstance(v, float)
             else str if isinstance(v, str) else None for v in items}
    return len(kinds) <= 1 and None not in kinds


def decode(value: Any) -> Any:
    """The state ``encode`` wrote, arrays as torch tensors (on the CPU)."""
    if isinstance(value, dict):
        if _SEQ in value:
            items = [decode(value[str(i)]) for i in range(len(value) - 1)]
            return tuple(items) if value[_SEQ] == "tuple" else items
        return {int(k[len(_INT):]) if k.startswith(_INT) else k: decode(v) for k, v in value.items()}
    if hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, (int, float)):
        return as_tensor(value)  # bfloat16 comes as a tensor already
    if isinstance(value, str) and value == _NONE:
        return None
    return value


def broadcast_data(value: Any, is_main: bool, what: str, group: Any = None) -> Any:
    """Rank 0's `value` on every rank of `group` (None: the job's group): plain data (None, bool,
    int, float, str, and lists, tuples and dicts of them, str or int keys), which comes back as
    it went. It travels as JSON in a tensor (``hpcdist.runtime.plain``), never as a pickle, so no
    rank unpickles what another process sent (docs/shared-sites.md). A value that is not plain
    data is one CheckpointError on every rank; torch's RuntimeError when the group fails or
    times out."""
    from hpcdist.runtime.plain import DataError, broadcast_plain

    try:
        return broadcast_plain(value if is_main else None, src=0, group=group, what=what)
    except DataError as exc:
        raise CheckpointError(str(exc)) from exc

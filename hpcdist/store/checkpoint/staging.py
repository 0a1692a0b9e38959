"""`snapshot`: the copy of a checkpoint's state an asynchronous save blocks for (its staging), in host memory.

Every array or tensor leaf is copied once, into reused buffers where an earlier snapshot of the
same layout is given (no fresh pages faulted in), a GPU's tensors straight into pinned host
memory. The writer (``rawio``) then writes the copy while training goes on. torch is imported
only for a device's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hpcdist.store import hostmem
from hpcdist.store.checkpoint.tree import Tree, check_leaf, from_bits, tensor_array, torch_dtype_name


def snapshot(tree: Mapping[str, Any], reuse: Mapping[str, Any] | None = None, prefix: str = "") -> Tree:
    """A copy of `tree` in host memory that later changes to its tensors do not reach.

    Every array or tensor leaf is copied into a NumPy array: into the same-shaped array of
    `reuse` (an earlier snapshot no longer in use, so no fresh pages are faulted in) when there is
    one, else into a new one. A tensor of a dtype NumPy lacks (bfloat16) is copied as its bits
    and kept as a CPU tensor of its dtype over that copy. Other leaves are kept (they are
    immutable values or lists of them).
    A tensor on a device (a GPU) is copied once, straight into host memory: into the reused
    tensor, else into a new one, pinned when CUDA is there (the copy then runs as DMA, all of
    them queued at once and waited for at the end); it stays a CPU tensor of its dtype.
    This is all an asynchronous save blocks for; a leaf HDF5 cannot store raises here, at the
    call, as a CheckpointError naming it (`check_leaf`).
    """
    queued: list[bool] = []
    out = _snapshot(tree, reuse, prefix, queued)
    if queued:
        import torch

        torch.cuda.synchronize()
    return out


def _snapshot(tree: Mapping[str, Any], reuse: Mapping[str, Any] | None, prefix: str, queued: list[bool]) -> Tree:
    out: Tree = {}
    for key, value in tree.items():
        old = reuse.get(key) if reuse is not None else None
        if isinstance(value, Mapping):
            out[key] = _snapshot(value, old if isinstance(old, Mapping) else None, f"{prefix}{key}/", queued)
            continue
        if hasattr(value, "detach") and not _on_cpu(value):
            out[key] = _device_copy(value, old, queued)
            continue
        src = _host_view(value)
        check_leaf(f"{prefix}{key}", value, src)
        if src is None:
            out[key] = list(value) if isinstance(value, list) else value
            continue
        bits = torch_dtype_name(value)  # "" unless the copy is kept as a tensor of that dtype
        mine = _host_view(old) if old is not None and torch_dtype_name(old) == bits else None
        if isinstance(mine, np.ndarray) and mine.shape == src.shape and mine.dtype == src.dtype:
            np.copyto(mine, src)
            out[key] = old
            continue
        if src is not value and not isinstance(value, np.ndarray) and not _on_cpu(value):
            copy = src  # already a fresh host copy (from a device)
        else:
            copy = hostmem.empty(src.shape, src.dtype)  # 4 KiB pages, as a torch copy: see hostmem
            np.copyto(copy, src)
        out[key] = from_bits(copy, bits) if bits else copy
    return out


def _device_copy(value: Any, old: Any, queued: list[bool]) -> Any:
    """A device tensor's one copy into host memory (`old`, an earlier copy of the same layout, when given)."""
    import torch

    src = value.detach()
    same = (isinstance(old, torch.Tensor) and _on_cpu(old) and old.shape == src.shape and old.dtype == src.dtype
            and old.is_contiguous())
    host = old if same else torch.empty(src.shape, dtype=src.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(src, non_blocking=host.is_pinned())
    if host.is_pinned():
        queued.append(True)
    return host


def _on_cpu(value: Any) -> bool:
    return str(getattr(value, "device", "cpu")) == "cpu"


def _host_view(value: Any) -> np.ndarray | None:
    """A leaf's array without copying where it can (CPU tensors and arrays), or None."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return tensor_array(value)
    return None

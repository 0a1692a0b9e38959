"""Nested dicts <-> HDF5 groups, every array with its checksum; the one HDF5-attribute converter.

A *tree* is a nested dict: a dict becomes a group, a NumPy array or a torch tensor becomes a
dataset carrying its digest (``hpcdist.store.checksum``: the attribute ``checksum``,
``"xxh3-128:<hex>"`` of its C-order bytes, in a checkpoint; ``sha256``, bare hex, in the files
that keep format 1), anything else (a number, a string, a list of strings) becomes an attribute
of its group. Reading gives back the
same shape: groups as dicts, datasets as NumPy arrays, attributes as plain Python values.

A tensor of a dtype NumPy has no type for (``bfloat16``, the ``float8_*`` kinds, ``complex32``)
is stored as its bits, in the unsigned integer of the same size, with the dataset attribute
``torch_dtype`` naming its dtype; it is read back as a CPU tensor of that dtype, bit for bit
(torch is imported then, and only then). Plain HDF5 readers see the unsigned integers.

This module owns that format: the attribute converters (`attr_value` in, `plain` out), the
flattening of a tree into datasets and attributes, reading through HDF5 with every
digest checked (hashing in threads: hashlib releases the GIL) and describing a group without
reading its data. Writing a tree, and the fast raw path of a checkpoint's arrays (``os.pwrite``,
the `TreeIndex`), is ``hpcdist.store.checkpoint.rawio``; reading by that index (``os.preadv``) is
``rawread``, the host copy of an asynchronous save ``staging``. torch is never
imported here: tensors are recognised by their methods and converted on the way in.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.errors import CheckpointError
from hpcdist.store import checksum

if TYPE_CHECKING:
    import h5py

Tree = dict[str, Any]  # nested: dict -> group, array/tensor -> dataset, scalar/str -> attribute
HASH_THREADS = 8
DTYPE_ATTR = "torch_dtype"  # a dataset's torch dtype, where NumPy has none: the data are its bits
# torch dtypes NumPy holds as they are; any other is stored as bits (`torch_bits`)
_NUMPY_DTYPES = frozenset({"float16", "float32", "float64", "complex64", "complex128", "bool", "int8", "int16",
                           "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


def hash_threads() -> int:
    return max(1, min(HASH_THREADS, os.cpu_count() or 1))


_POOLS: dict[str, ThreadPoolExecutor] = {}


def pool(name: str, workers: int, initializer: Callable[[], None] | None = None) -> ThreadPoolExecutor:
    """The process's thread pool `name`, made at first use and kept: starting threads at every save
    and load cost 2-8 ms each on 2 busy cores (a new thread waits for a time slice before
    ``start`` returns), several per save. Its tasks never wait on the same pool; callers wait
    for every future they submitted, errors included, before they return.

    Every thread of the store is one of these: ``hash`` (verifying reads: `read_tree`,
    ``rawread.read_indexed``, the sharded reader), ``hash-low`` (hashing beside a write, at a lower
    priority), ``write`` (the raw writer), ``checkpoint`` (a background save, ``CheckpointStore.save_async``;
    its threads are named ``hpcdist-checkpoint_N`` in stacks, as before the pools)
    and ``purge`` (deleting pruned shard folders)."""
    found = _POOLS.get(name)
    if found is None:
        found = _POOLS[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"hpcdist-{name}",
                                                  initializer=initializer)
    return found


# A forked child has the parent's executors but not their threads: it makes its own.
os.register_at_fork(after_in_child=_POOLS.clear)


def sha256_of(arr: np.ndarray) -> str:
    """Hex SHA-256 of the array's C-order bytes (hashed in place: no copy for contiguous arrays)."""
    data = np.ascontiguousarray(arr)
    return hashlib.sha256(data.reshape(-1).view(np.uint8).data if data.size else b"").hexdigest()


def plain(value: Any) -> Any:
    """An HDF5 attribute (or array element) as a plain Python value: bytes decoded, NumPy unwrapped."""
    if isinstance(value, bytes):
        return value.decode()
    if hasattr(value, "tolist"):  # NumPy scalars and arrays
        value = value.tolist()
        if isinstance(value, list):
            return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


def host_value(value: Any) -> Any:
    """A figure as NumPy can read it: a tensor (on a GPU, with grad, in bfloat16) copied to the host
    as an array (a 0-d one as a number, bfloat16 widened to float32), a list or tuple of them each
    so; anything else as it is. Results take what a script has, and a CUDA loss is what it has."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        t = value.detach().cpu()
        if torch_dtype_name(t):
            t = t.float()
        return t.item() if t.dim() == 0 else t.numpy()
    if isinstance(value, (list, tuple)) and any(hasattr(v, "detach") for v in value):
        return [host_value(v) for v in value]
    return value


def attr_value(value: Any) -> Any:
    """A Python value as h5py stores it: None as "", str subclasses as str, string lists as UTF-8,
    tensors as `host_value` makes them."""
    value = host_value(value)
    if value is None:
        return ""
    if isinstance(value, str):
        return str(value)  # plain str: subclasses such as torch's TorchVersion do not convert
    if _string_list(value):
        import h5py

        return np.array(value, dtype=h5py.string_dtype())
    return value


def _string_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


def torch_dtype_name(value: Any) -> str:
    """The dtype's name of a tensor that NumPy cannot hold ("bfloat16"), else ""."""
    if not (hasattr(value, "detach") and hasattr(value, "numpy")):
        return ""
    name = str(value.dtype).removeprefix("torch.")
    return "" if name in _NUMPY_DTYPES else name


def tensor_array(value: Any) -> np.ndarray:
    """A tensor's data as a NumPy array, without a copy for a CPU tensor: the bits, as unsigned
    integers of the same size, for a dtype NumPy has no type for (`torch_dtype_name`)."""
    t = value.detach()
    if torch_dtype_name(t):
        import torch

        t = t.view(getattr(torch, f"uint{8 * t.element_size()}"))
    return np.asarray(t.cpu().numpy())


def from_bits(arr: np.ndarray, name: str) -> Any:
    """The tensor of dtype `name` whose bits `arr` holds (sharing its memory)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"dataset dtype {name!r} is not a dtype of this torch ({torch.__version__}); "
                              f"upgrade torch to read it")
    return torch.from_numpy(np.ascontiguousarray(arr)).view(dtype)


def is_bits(name: str) -> bool:
    """Whether a tensor of dtype `name` ("bfloat16") is stored as its bits, NumPy having no type for it."""
    return name not in _NUMPY_DTYPES


def typed(arr: np.ndarray, name: str) -> Any:
    """The leaf a dataset of torch dtype `name` reads as, from `arr` as HDF5 holds it: a tensor of
    that dtype over its bits (`from_bits`) where NumPy has no type for it, else `arr` itself."""
    return from_bits(arr, name) if is_bits(name) else arr


def as_tensor(value: Any) -> Any:
    """A dataset leaf as read (a NumPy array, or a tensor of a dtype NumPy lacks) as a CPU torch
    tensor of its dtype, sharing its memory (a read-only or strided array is copied first)."""
    if hasattr(value, "detach"):
        return value
    import torch

    arr = np.asarray(value)
    return torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())


def as_array(value: Any) -> np.ndarray | None:
    """A dataset's array for a tree leaf, or None if the leaf is an attribute."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch.Tensor
        return np.ascontiguousarray(tensor_array(value))
    return None


# NumPy kinds HDF5 has no type for: object, unicode text, datetime, timedelta
UNSTORABLE_KINDS = "OUMm"


def check_leaf(path: str, value: Any, arr: np.ndarray | None) -> None:
    """Raise a CheckpointError naming `path` when HDF5 cannot store the leaf `value` (`arr`: its
    array, None for an attribute), before anything is written."""
    if arr is None:
        if value is None or isinstance(value, (str, bytes)) or _string_list(value):
            return  # stored as a string (`attr_value`)
        try:
            arr = np.asarray(value)
        except ValueError:  # a ragged list
            arr = np.empty(0, dtype=object)
    if arr.dtype.kind not in UNSTORABLE_KINDS:
        return
    what = type(value).__name__ + (f" of dtype {arr.dtype}" if hasattr(value, "dtype") else "")
    raise CheckpointError(
        f"cannot checkpoint {path!r} ({what}): HDF5 has no form for it; keep tensors, NumPy arrays of numbers, "
        "numbers, strings and lists of one of these in the state, and convert other objects first "
        "(e.g. a dict of plain values with json.dumps)"
    )


def flatten(
    tree: Mapping[str, Any], prefix: str = ""
) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, str, Any]], dict[str, str]]:
    """(dataset path, array), (group path, attribute name, value) and {dataset path: torch dtype
    stored as bits} for a nested tree; a leaf HDF5 cannot store raises a CheckpointError naming
    it (`check_leaf`)."""
    arrays: list[tuple[str, np.ndarray]] = []
    attrs: list[tuple[str, str, Any]] = []
    dtypes: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            sub_arrays, sub_attrs, sub_dtypes = flatten(value, f"{prefix}{key}/")
            arrays += sub_arrays
            attrs += sub_attrs
            dtypes |= sub_dtypes
            attrs.append((f"{prefix}{key}", "", None))  # the group exists even when empty
            continue
        arr = as_array(value)
        check_leaf(f"{prefix}{key}", value, arr)
        if arr is None:
            attrs.append((prefix.rstrip("/") or "/", key, attr_value(value)))
        else:
            arrays.append((f"{prefix}{key}", arr))
            if name := torch_dtype_name(value):
                dtypes[f"{prefix}{key}"] = name
    return arrays, attrs, dtypes


# ---------------------------------------------------------------- reading


class ChecksumError(CheckpointError):
    """A dataset whose bytes do not match its recorded digest (or that has none)."""

    def __init__(self, message: str, dataset: str) -> None:
        super().__init__(message)
        self.dataset = dataset


Check = tuple[str, "Future[str] | None", str]  # dataset name, its digest being computed, the recorded digest


def hash_like(hashing: ThreadPoolExecutor, arr: np.ndarray, recorded: str) -> Future[str]:
    """`arr`'s digest with `recorded`'s algorithm, made in `hashing` (a pool's thread)."""
    checksum.algorithm_of(recorded)  # an unknown algorithm fails here, in the caller, in one line
    return hashing.submit(checksum.digest_like, arr, recorded)


def _read_group(group: h5py.Group, hashing: ThreadPoolExecutor | None, checks: list[Check]) -> tuple[Tree, int]:
    import h5py

    out: Tree = {k: plain(v) for k, v in group.attrs.items()}
    nbytes = 0
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            out[key], n = _read_group(item, hashing, checks)
            nbytes += n
            continue
        arr = np.asarray(item[()])
        nbytes += arr.nbytes
        recorded = checksum.recorded_in(item.attrs)
        digest = hash_like(hashing, arr, recorded) if hashing is not None and recorded else None
        checks.append((item.name, digest, recorded))
        dtype = plain(item.attrs.get(DTYPE_ATTR, ""))
        out[key] = typed(arr, str(dtype)) if dtype else arr
    return out, nbytes


def read_tree(groups: Mapping[str, h5py.Group], *, verify: bool, where: object) -> tuple[Tree, int]:
    """Each named group as a tree and the array bytes read; with `verify`, every digest is checked.

    A mismatch raises ChecksumError naming `where` (the file) and the dataset.
    """
    tree: Tree = {}
    nbytes = 0
    checks: list[Check] = []
    hashing = pool("hash", hash_threads()) if verify else None  # the store's one hashing pool (`pool`)
    try:
        for name, group in groups.items():
            tree[name], n = _read_group(group, hashing, checks)
            nbytes += n
        check_digests(checks, verify=verify, where=where)
    finally:  # nothing of this call still hashing when it returns, failed or not
        wait([digest for _, digest, _ in checks if digest is not None])
    return tree, nbytes


def check_digests(checks: list[Check], *, verify: bool, where: object) -> None:
    if not verify:
        return
    for dataset, digest, expected in checks:
        if not expected:
            raise ChecksumError(f"{where}: dataset {dataset} has no checksum attribute", dataset)
        if digest is not None and digest.result() != expected:
            raise ChecksumError(f"{where}: dataset {dataset} fails its {checksum.algorithm_of(expected)} check "
                                "(data corrupted)", dataset)


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset described without reading its data."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]  # as HDF5 holds it: the unsigned integer of the bits for a `torch_dtype`
    digest: str  # as recorded (``hpcdist.store.checksum``)
    torch_dtype: str = ""  # the torch dtype its bits hold, where NumPy has none ("bfloat16"), else ""

    @property
    def dtype_name(self) -> str:
        """The dtype of the data: "bfloat16" for bits, else NumPy's name ("float32")."""
        return self.torch_dtype or self.dtype.name


def describe_group(group: h5py.Group) -> dict[str, DatasetInfo]:
    """Shape, dtype and recorded digest of each dataset directly in `group` (no data read)."""
    import h5py

    return {
        k: DatasetInfo(tuple(int(n) for n in d.shape), d.dtype, checksum.recorded_in(d.attrs),
                       str(plain(d.attrs.get(DTYPE_ATTR, ""))))
        for k, d in group.items()
        if isinstance(d, h5py.Dataset)
    }

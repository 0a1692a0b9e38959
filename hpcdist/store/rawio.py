"""The fast path of a checkpoint's arrays: raw writes and reads beside HDF5, and `snapshot`.

`write_tree` writes a tree in the format of ``hpcdist.store.tree`` while a thread pool hashes
its arrays. A checkpoint's numeric arrays are written without HDF5's copy: their contiguous
storage is allocated when the dataset is created (through h5py's low-level API) and one writer
thread puts their bytes there with ``os.pwrite`` (``write_tree(..., raw=path)``); the
`TreeIndex` it returns (where each array lies, its sha256) lets `read_indexed` read them back
with one ``os.preadv`` each, hashing overlapped, without walking HDF5 objects (~0.4 ms each
through h5py). `snapshot` is the copy an asynchronous save blocks for. The file stays the same
HDF5 a plain ``create_dataset(data=...)`` writes; torch is never imported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.errors import CheckpointError
from hpcdist.store import hostmem
from hpcdist.store.tree import Check, Tree, check_digests, flatten, hash_threads, plain, sha256_of

if TYPE_CHECKING:
    import h5py

BATCH_BYTES = 8 << 20  # work handed to a hashing or writing thread at once


def _batches(arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Consecutive arrays grouped into batches of about BATCH_BYTES (a larger array alone)."""
    out: list[list[np.ndarray]] = [[]]
    size = 0
    for arr in arrays:
        if out[-1] and size + arr.nbytes > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(arr)
        size += arr.nbytes
    return [b for b in out if b]


def _sha256_batch(arrays: list[np.ndarray]) -> list[str]:
    return [sha256_of(a) for a in arrays]


# ---------------------------------------------------------------- the copy an async save takes


def snapshot(tree: Mapping[str, Any], reuse: Mapping[str, Any] | None = None) -> Tree:
    """A copy of `tree` in host memory that later changes to its tensors do not reach.

    Every array or tensor leaf is copied into a NumPy array: into the same-shaped array of
    `reuse` (an earlier snapshot no longer in use, so no fresh pages are faulted in) when there is
    one, else into a new one. Other leaves are kept (they are immutable values or lists of them).
    This is all an asynchronous save blocks for.
    """
    out: Tree = {}
    for key, value in tree.items():
        old = reuse.get(key) if reuse is not None else None
        if isinstance(value, Mapping):
            out[key] = snapshot(value, old if isinstance(old, Mapping) else None)
            continue
        src = _host_view(value)
        if src is None:
            out[key] = list(value) if isinstance(value, list) else value
            continue
        if isinstance(old, np.ndarray) and old.shape == src.shape and old.dtype == src.dtype:
            np.copyto(old, src)
            out[key] = old
        elif src is not value and not isinstance(value, np.ndarray) and not _on_cpu(value):
            out[key] = src  # already a fresh host copy (from a device)
        else:
            copy = hostmem.empty(src.shape, src.dtype)  # huge pages: the first save faults in fewer
            np.copyto(copy, src)
            out[key] = copy
    return out


def _on_cpu(value: Any) -> bool:
    return str(getattr(value, "device", "cpu")) == "cpu"


def _host_view(value: Any) -> np.ndarray | None:
    """A leaf's array without copying where it can (CPU tensors and arrays), or None."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        t = value.detach()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return np.asarray(t.cpu().numpy())
    return None


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class Placed:
    """Where one dataset's bytes lie in its file: what a checkpoint's index records per array."""

    name: str  # absolute HDF5 path, e.g. "/model/wte"
    offset: int  # byte offset of the contiguous data in the file
    dtype: str  # NumPy dtype string, e.g. "<f4"
    shape: tuple[int, ...]
    sha256: str


@dataclass(frozen=True)
class TreeIndex:
    """A written tree's groups and datasets, with where each numeric array's bytes lie.

    Stored by a checkpoint as its root attribute ``index_json``, so a reader reads every array
    with one `os.preadv` into a preallocated array and verifies it against the recorded sha256
    (hashing overlapped with reading), instead of walking HDF5 objects one by one; the HDF5
    structure stays the truth (`read_indexed` refuses an index that does not match the file).
    """

    groups: list[str]  # absolute paths of every group below the root, parents first
    placed: list[Placed]
    others: list[str]  # datasets read through HDF5 (empty, strings, non-native)
    nbytes: int = 0

    def to_json(self) -> str:
        return json.dumps({
            "groups": self.groups,
            "datasets": [[p.name, p.offset, p.dtype, list(p.shape), p.sha256] for p in self.placed],
            "others": self.others,
            "bytes": self.nbytes,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TreeIndex:
        data = json.loads(text)
        placed = [Placed(str(n), int(o), str(t), tuple(int(x) for x in shape), str(h))
                  for n, o, t, shape, h in data["datasets"]]
        return cls([str(g) for g in data["groups"]], placed, [str(o) for o in data["others"]], int(data["bytes"]))


def _raw_layout() -> Any:
    """Contiguous storage allocated at creation and never filled: the bytes are ours to write."""
    import h5py

    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def _create_raw(g: Any, leaf: str, arr: np.ndarray, dcpl: Any) -> Any:
    import h5py

    space = h5py.h5s.create_simple(arr.shape) if arr.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
    return h5py.h5d.create(g.id, leaf.encode(), h5py.h5t.py_create(arr.dtype, logical=True), space, dcpl=dcpl)


def _set_sha256(dset: Any, digest: str) -> str:
    """The ``sha256`` attribute as h5py writes a str (variable-length UTF-8), set on a DatasetID."""
    import h5py

    kind = h5py.string_dtype()
    attr = h5py.h5a.create(dset, b"sha256", h5py.h5t.py_create(kind, logical=True), h5py.h5s.create(h5py.h5s.SCALAR))
    attr.write(np.array(digest, dtype=kind))
    return digest


def _raw_ok(arr: np.ndarray) -> bool:
    """Arrays whose HDF5 bytes are their memory bytes: native numbers and booleans, not empty."""
    return arr.size > 0 and arr.dtype.kind in "biuf" and arr.dtype.isnative and arr.flags.c_contiguous


class _RawWriter:
    """Writes arrays at file offsets with `os.pwrite` (no GIL held) in one thread, in the order
    given, and fdatasyncs after the last batch, while datasets are still being created and the
    pool hashes. (Starting writeback early with ``sync_file_range`` measured slower here.)"""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY)
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.jobs: list[Future[None]] = []

    def write(self, parts: list[tuple[int, np.ndarray]], last: bool = False) -> None:
        self.jobs.append(self.pool.submit(self._write, parts, last))

    def _write(self, parts: list[tuple[int, np.ndarray]], last: bool) -> None:
        for offset, arr in parts:
            _pwrite_all(self.fd, arr, offset)
        if last:
            os.fdatasync(self.fd)

    def wait(self) -> None:
        """All written and on disk (HDF5 writes its metadata at close, fsynced after)."""
        for job in self.jobs:
            job.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True)
            os.close(self.fd)


def _pwrite_all(fd: int, arr: np.ndarray, offset: int) -> None:
    view = arr.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + (1 << 30)], offset + done)


def write_tree(f: h5py.Group, tree: Mapping[str, Any], raw: Path | None = None) -> TreeIndex:
    """Datasets (each with its sha256) and attributes of `tree` under `f`; its `TreeIndex`.

    Arrays are hashed in a thread pool while they are written. With `raw` (the path of the file
    `f` belongs to), numeric arrays get contiguous storage allocated up front and their bytes are
    written straight to the file by a writer thread and fdatasynced, overlapping the hashing:
    the file is the same HDF5 a plain `create_dataset(data=...)` writes, without HDF5's copy.
    """
    arrays, attrs = flatten(tree)
    groups: dict[str, Any] = {"/": f}
    base = f.name.rstrip("/")

    def group(name: str) -> Any:
        if name not in groups:
            groups[name] = f.require_group(name)
        return groups[name]

    for name, key, value in attrs:
        g = group(name)
        if key:
            g.attrs[key] = value
    writer = _RawWriter(raw) if raw is not None else None
    placed: list[Placed] = []
    others: list[str] = []
    dsets: list[Any] = []  # low-level DatasetIDs: h5py's high-level wrapper costs ~3x per dataset
    # Threads get work in batches of BATCH_BYTES: a thread that finishes a task while this one
    # holds the GIL (creating datasets) waits for it, so many small tasks would stall them.
    try:
        with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
            digests = [pool.submit(_sha256_batch, batch) for batch in _batches([a for _, a in arrays])]
            dcpl = _raw_layout()
            pending: list[tuple[int, np.ndarray]] = []
            for name, arr in arrays:
                parent, _, leaf = name.rpartition("/")
                g = group(parent or "/")
                if writer is not None and _raw_ok(arr):
                    dset = _create_raw(g, leaf, arr, dcpl)
                    offset = int(dset.get_offset())
                    placed.append(Placed(f"{base}/{name}", offset, arr.dtype.str, tuple(arr.shape), ""))
                    pending.append((offset, arr))
                    if sum(a.nbytes for _, a in pending) >= BATCH_BYTES:
                        writer.write(pending)
                        pending = []
                else:
                    dset = g.create_dataset(leaf, data=arr).id
                    others.append(f"{base}/{name}")
                dsets.append(dset)
            if writer is not None:
                writer.write(pending, last=True)
            hex_digests = [h for batch in digests for h in batch.result()]
        hashes = {
            f"{base}/{name}": _set_sha256(dset, digest)
            for (name, _), dset, digest in zip(arrays, dsets, hex_digests, strict=True)
        }
        if writer is not None:
            writer.wait()
    finally:
        if writer is not None:
            writer.close()
    placed = [Placed(p.name, p.offset, p.dtype, p.shape, hashes[p.name]) for p in placed]
    group_names = sorted({f"{base}/{g.strip('/')}" for g in groups if g != "/"}, key=lambda g: (g.count("/"), g))
    return TreeIndex(group_names, placed, others, sum(a.nbytes for _, a in arrays))


# ---------------------------------------------------------------- reading


def read_indexed(
    f: h5py.File, path: Path, index: TreeIndex, names: list[str], *, verify: bool, where: object
) -> tuple[Tree, int]:
    """The top-level groups `names` of checkpoint file `f` (at `path`) read by its `index`.

    Group attributes and the `others` come through HDF5; each placed array is read with one
    `os.preadv` into a new array while a thread pool hashes those already read. Raises
    CheckpointError if the index disagrees with the file (a dataset moved or missing) and
    ChecksumError if bytes do not match their sha256; the caller then reads through HDF5.
    """
    import h5py

    wanted = {f"/{n}" for n in names}

    def selected(name: str) -> bool:
        return "/" + name.split("/")[1] in wanted

    tree: Tree = {}

    def node(name: str) -> Tree:
        out = tree
        for part in name.strip("/").split("/"):
            out = out.setdefault(part, {})
        return out

    for g in sorted((g for g in index.groups if selected(g)), key=lambda g: g.count("/")):
        group = f[g]
        if not isinstance(group, h5py.Group):
            raise CheckpointError(f"{where}: index names {g} as a group, the file does not")
        node(g).update({k: plain(v) for k, v in group.attrs.items()})
    checks: list[Check] = []
    nbytes = 0
    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        for name in (o for o in index.others if selected(o)):
            item = f[name]
            arr = np.asarray(item[()])
            nbytes += arr.nbytes
            recorded = str(plain(item.attrs.get("sha256", "")))
            checks.append((name, pool.submit(sha256_of, arr) if verify else None, recorded))
            parent, _, leaf = name.rpartition("/")
            node(parent)[leaf] = arr
        fd = os.open(path, os.O_RDONLY)
        try:
            for p in (p for p in index.placed if selected(p.name)):
                arr = hostmem.empty(p.shape, np.dtype(p.dtype))  # huge pages: fewer faults
                if arr.nbytes and os.preadv(fd, [arr.reshape(-1).view(np.uint8).data], p.offset) != arr.nbytes:
                    raise CheckpointError(f"{where}: dataset {p.name} lies past the end of the file; truncated")
                nbytes += arr.nbytes
                checks.append((p.name, pool.submit(sha256_of, arr) if verify else None, p.sha256))
                parent, _, leaf = p.name.rpartition("/")
                node(parent)[leaf] = arr
        finally:
            os.close(fd)
        check_digests(checks, verify=verify, where=where)
    return {n: tree.get(n, {}) for n in names}, nbytes


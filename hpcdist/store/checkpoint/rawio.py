"""The fast path of a checkpoint's arrays: the raw writer beside HDF5, and the index it records.

`write_tree` writes a tree in the format of ``hpcdist.store.checkpoint.tree`` while a thread pool hashes
its arrays (``hpcdist.store.checksum``). A checkpoint's numeric arrays are written without HDF5's copy: their contiguous
storage is allocated when the dataset is created (through h5py's low-level API) and one writer
thread puts their bytes there with ``os.pwritev``, starting the disk's writeback as it goes
(``write_tree(..., raw=path)``); the
`TreeIndex` it returns (where each array lies, its digest) lets ``rawread.read_indexed`` read them
back with one ``os.preadv`` each, hashing overlapped, without walking HDF5 objects (~0.4 ms each
through h5py). The copy an asynchronous save blocks for is ``staging.py``'s. The file stays the
same HDF5 a plain ``create_dataset(data=...)`` writes; torch is never imported here.

The writer, the reader (``rawread.py``) and the staging copy (``staging.py``) share the layout
(`TreeIndex`, `Placed`) and the thread pools of ``tree.py``; one benchmark measures them together
(``benchmarks/train_checkpoint_io.py``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import threading
from collections.abc import Mapping
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.store import checksum
from hpcdist.store.checkpoint.tree import (
    DTYPE_ATTR,
    flatten,
    hash_threads,
    pool,
    sha256_of,
)

if TYPE_CHECKING:
    import h5py

BATCH_BYTES = 8 << 20  # work handed to a hashing or writing thread at once


def _digest_batch(arrays: list[np.ndarray], algorithm: str | None) -> list[str]:
    """Each array's recorded digest: `algorithm`'s (``"xxh3-128:<hex>"``), or format 1's bare sha256 for None."""
    return [checksum.digest(a, algorithm) if algorithm else sha256_of(a) for a in arrays]


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class Placed:
    """Where one dataset's bytes lie in its file: what a checkpoint's index records per array."""

    name: str  # absolute HDF5 path, e.g. "/model/wte"
    offset: int  # byte offset of the contiguous data in the file
    dtype: str  # NumPy dtype string, e.g. "<f4"
    shape: tuple[int, ...]
    digest: str  # as recorded (``hpcdist.store.checksum``)


@dataclass(frozen=True)
class TreeIndex:
    """A written tree's groups and datasets, with where each numeric array's bytes lie.

    Stored by a checkpoint as its root attribute ``index_json``, so a reader reads every array
    with one `os.preadv` into a preallocated array and verifies it against the recorded digest
    (hashing overlapped with reading), instead of walking HDF5 objects one by one; the HDF5
    structure stays the truth (`read_indexed` refuses an index that does not match the file).
    """

    groups: list[str]  # absolute paths of every group below the root, parents first
    placed: list[Placed]
    others: list[str]  # datasets read through HDF5 (empty, strings, non-native)
    nbytes: int = 0
    dtypes: dict[str, str] = field(default_factory=dict)  # dataset -> torch dtype its bits hold (`DTYPE_ATTR`)

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "groups": self.groups,
            "datasets": [[p.name, p.offset, p.dtype, list(p.shape), p.digest] for p in self.placed],
            "others": self.others,
            "bytes": self.nbytes,
        }
        if self.dtypes:  # only then: a file without such tensors is the same as before
            data["dtypes"] = self.dtypes
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TreeIndex:
        data = json.loads(text)
        placed = [Placed(str(n), int(o), str(t), tuple(int(x) for x in shape), str(h))
                  for n, o, t, shape, h in data["datasets"]]
        dtypes = {str(k): str(v) for k, v in data.get("dtypes", {}).items()}
        return cls([str(g) for g in data["groups"]], placed, [str(o) for o in data["others"]], int(data["bytes"]),
                   dtypes)


def _raw_layout() -> Any:
    """Contiguous storage allocated at creation and never filled: the bytes are ours to write."""
    import h5py

    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


class _Objects:
    """Groups, raw datasets and digest attributes of one `write_tree`, made through h5py's
    low-level API: its high-level wrappers cost about 3x per object, and on the critical path
    (a dataset must exist before its bytes can be written) every object counts."""

    def __init__(self, f: h5py.Group) -> None:
        import h5py

        self.f = f
        self.ids: dict[str, Any] = {"": f.id}  # group path relative to f -> GroupID
        self.dcpl = _raw_layout()
        self.types: dict[str, Any] = {}
        self.spaces: dict[tuple[int, ...], Any] = {}
        self.text = h5py.string_dtype()  # the digest attribute as h5py writes a str: variable-length UTF-8
        self.text_type = h5py.h5t.py_create(self.text, logical=True)
        self.scalar = h5py.h5s.create(h5py.h5s.SCALAR)

    def group(self, name: str) -> Any:
        """The GroupID of `name` below f ("" or "/" for f), made with its parents when new."""
        import h5py

        name = name.strip("/")
        gid = self.ids.get(name)
        if gid is None:
            parent, _, leaf = name.rpartition("/")
            pid, key = self.group(parent), leaf.encode()
            gid = h5py.h5g.open(pid, key) if key in pid else h5py.h5g.create(pid, key)
            self.ids[name] = gid
        return gid

    def high(self, name: str) -> Any:
        """The h5py Group of `name`, for its attributes and the datasets HDF5 writes itself."""
        import h5py

        gid = self.group(name)
        return self.f if gid is self.f.id else h5py.Group(gid)

    def raw_dataset(self, parent: str, leaf: str, arr: np.ndarray) -> Any:
        """A DatasetID with `arr`'s shape and type whose contiguous storage is allocated, unwritten."""
        import h5py

        dtype = self.types.get(arr.dtype.str)
        if dtype is None:
            dtype = self.types[arr.dtype.str] = h5py.h5t.py_create(arr.dtype, logical=True)
        space = self.spaces.get(arr.shape)  # AdamW's moments have their parameter's shape
        if space is None:
            space = self.spaces[arr.shape] = h5py.h5s.create_simple(arr.shape) if arr.ndim else self.scalar
        return h5py.h5d.create(self.group(parent), leaf.encode(), dtype, space, dcpl=self.dcpl)

    def set_digest(self, dset: Any, digest: str, algorithm: str | None) -> None:
        self.set_text(dset, (checksum.ATTR if algorithm else checksum.LEGACY_ATTR).encode(), digest)

    def set_text(self, dset: Any, name: bytes, value: str) -> None:
        import h5py

        h5py.h5a.create(dset, name, self.text_type, self.scalar).write(np.array(value, dtype=self.text))


def _raw_ok(arr: np.ndarray) -> bool:
    """Arrays whose HDF5 bytes are their memory bytes: native numbers and booleans, not empty."""
    return arr.size > 0 and arr.dtype.kind in "biuf" and arr.dtype.isnative and arr.flags.c_contiguous


RUN_BYTES = 1 << 30  # at most this much in one pwritev (Linux writes at most ~2 GiB per call)
IOV_MAX = 1024  # buffers in one pwritev (Linux's UIO_MAXIOV)


def _runs(parts: list[tuple[int, np.ndarray]]) -> list[tuple[int, list[memoryview]]]:
    """Arrays at file offsets as runs of consecutive bytes: one pwritev each instead of one call
    (and one wait for the GIL) per array."""
    runs: list[tuple[int, list[memoryview]]] = []
    end = size = -1
    for offset, arr in parts:
        view = arr.reshape(-1).view(np.uint8).data
        for start in range(0, len(view), RUN_BYTES):
            chunk, at = view[start : start + RUN_BYTES], offset + start
            if runs and at == end and len(runs[-1][1]) < IOV_MAX and size + len(chunk) <= RUN_BYTES:
                runs[-1][1].append(chunk)
                size += len(chunk)
            else:
                runs.append((at, [chunk]))
                size = len(chunk)
            end = at + len(chunk)
    return runs


def _pwritev_all(fd: int, offset: int, views: list[memoryview]) -> None:
    views = list(views)
    while views:
        done = os.pwritev(fd, views, offset)
        if done <= 0:
            raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
        offset += done
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if done:
            views[0] = views[0][done:]


def _sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; wait for nothing


class _RawWriter:
    """Writes arrays at file offsets in one thread (``os.pwritev`` per run of consecutive
    arrays; no GIL held) while datasets are still being created and the pool hashes, asks Linux
    to start each run's writeback at once (``sync_file_range``, no wait), and fdatasyncs after the
    last batch. With the early writeback the disk works while the rest is written and the final
    fdatasync has little left (``dd conv=fsync`` starts it only at the end): 109 MB saves went
    from 0.30-0.38x to 0.58-0.65x dd in an interleaved A/B at load 2.6. (Started per array, not
    per run, it had measured slower.)"""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY)
        self.pool = pool("write", 1)  # one writer thread per process: every file's runs in order
        self.jobs: list[Future[None]] = []

    def write(self, parts: list[tuple[int, np.ndarray]], last: bool = False) -> None:
        self.jobs.append(self.pool.submit(self._write, parts, last))

    def _write(self, parts: list[tuple[int, np.ndarray]], last: bool) -> None:
        for offset, views in _runs(parts):
            _pwritev_all(self.fd, offset, views)
            if _SYNC_FILE_RANGE is not None:
                _SYNC_FILE_RANGE(self.fd, offset, sum(len(v) for v in views), SYNC_FILE_RANGE_WRITE)
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
            futures.wait(self.jobs)  # none still writing to the descriptor, failed or not
            os.close(self.fd)


HASH_NICE = 5  # how much lower the hashing threads' priority is than the writer's and the caller's


def _yield_cpu() -> None:
    """Lower this (hashing) thread's priority on Linux, where a thread has its own: the thread
    making datasets and the writer are the path to the disk, and on 2 cores hashing beside them
    at the same priority took their cores (256 datasets took 87-166 ms to make instead of 17-45
    ms); at a lower one it fills the time they leave, the disk's flush included."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + HASH_NICE))
    except OSError:
        pass


def _batches(sizes: list[int]) -> list[range]:
    """Consecutive indices grouped into batches of about BATCH_BYTES (a larger array alone)."""
    out: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > BATCH_BYTES:
            out.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def write_tree(f: h5py.Group, tree: Mapping[str, Any], raw: Path | None = None,
               algorithm: str | None = None) -> TreeIndex:
    """Datasets (each with its digest) and attributes of `tree` under `f`; its `TreeIndex`.

    `algorithm` (``hpcdist.store.checksum``) records each digest as ``checksum = "<algorithm>:<hex>"``
    (a checkpoint, format 2); None keeps format 1's bare ``sha256`` (token files).

    Arrays are hashed in a thread pool while they are written. With `raw` (the path of the file
    `f` belongs to), numeric arrays get contiguous storage allocated up front and their bytes are
    written straight to the file by a writer thread and fdatasynced, overlapping the hashing:
    the file is the same HDF5 a plain `create_dataset(data=...)` writes, without HDF5's copy.
    Batches of BATCH_BYTES go to the writer as soon as their datasets exist; each batch's
    digest attributes are set as soon as its hashes are done.
    """
    arrays, attrs, dtypes = flatten(tree)
    objs = _Objects(f)
    base = f.name.rstrip("/")
    for name, key, value in attrs:
        objs.group(name)  # a group exists even when empty
        if key:
            objs.high(name).attrs[key] = value
    offsets: dict[int, int] = {}  # index in `arrays` -> where its bytes lie
    others: list[str] = []
    dsets: list[Any] = []
    hashing = pool("hash-low", hash_threads(), initializer=_yield_cpu)
    batches = _batches([a.nbytes for _, a in arrays])
    digests: list[Future[list[str]]] = []
    writer = None
    try:
        digests += [hashing.submit(_digest_batch, [arrays[i][1] for i in batch], algorithm) for batch in batches]
        writer = _RawWriter(raw) if raw is not None else None
        for n, batch in enumerate(batches):
            parts: list[tuple[int, np.ndarray]] = []
            for i in batch:
                name, arr = arrays[i]
                parent, _, leaf = name.rpartition("/")
                if writer is not None and _raw_ok(arr):
                    dset = objs.raw_dataset(parent, leaf, arr)
                    offsets[i] = int(dset.get_offset())
                    parts.append((offsets[i], arr))
                else:
                    dset = objs.high(parent).create_dataset(leaf, data=arr).id
                    others.append(f"{base}/{name}")
                if name in dtypes:
                    objs.set_text(dset, DTYPE_ATTR.encode(), dtypes[name])
                dsets.append(dset)
            if writer is not None:
                writer.write(parts, last=n == len(batches) - 1)
        # No arrays (an index file): nothing to sync early; the caller's fsync at commit covers the file.
        hashes: list[str] = []
        for batch, digest in zip(batches, digests, strict=True):
            for i, hex_digest in zip(batch, digest.result(), strict=True):
                objs.set_digest(dsets[i], hex_digest, algorithm)
                hashes.append(hex_digest)
        if writer is not None:
            writer.wait()
    finally:
        futures.wait(digests)  # nothing of this call still hashing when it returns, failed or not
        if writer is not None:
            writer.close()
    placed = [
        Placed(f"{base}/{arrays[i][0]}", offset, arrays[i][1].dtype.str, tuple(arrays[i][1].shape), hashes[i])
        for i, offset in offsets.items()
    ]
    group_names = sorted((f"{base}/{g}" for g in objs.ids if g), key=lambda g: (g.count("/"), g))
    return TreeIndex(group_names, placed, others, sum(a.nbytes for _, a in arrays),
                     {f"{base}/{name}": dtype for name, dtype in dtypes.items()})



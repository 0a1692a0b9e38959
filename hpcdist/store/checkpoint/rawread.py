"""`read_indexed`: a checkpoint's arrays read back by the `TreeIndex` its writer recorded (``rawio``).

Each placed array is read with one ``os.preadv`` (or mapped copy-on-write) while a thread pool
hashes those already read, instead of walking HDF5 objects one by one; the HDF5 structure stays
the truth (an index that does not match the file is refused). torch is never imported here.
"""

from __future__ import annotations

import os
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.errors import CheckpointError
from hpcdist.store import checksum, hostmem
from hpcdist.store.checkpoint.tree import Check, Tree, check_digests, from_bits, hash_like, hash_threads, plain, pool

if TYPE_CHECKING:
    import h5py

    from hpcdist.store.checkpoint.rawio import TreeIndex


def _mapping(fd: int) -> Any:
    """The whole file `fd` mapped copy-on-write (None where it cannot be: read it instead)."""
    import mmap

    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
    except (OSError, ValueError):
        return None


def read_indexed(
    f: h5py.File, path: Path, index: TreeIndex, names: list[str], *, verify: bool, where: object,
    mapped: bool = False,
) -> tuple[Tree, int]:
    """The top-level groups `names` of checkpoint file `f` (at `path`) read by its `index`.

    Group attributes and the `others` come through HDF5; each placed array is read with one
    `os.preadv` into a new array while a thread pool hashes those already read; with `mapped`
    each is instead a copy-on-write view of the file's pages (``MAP_PRIVATE``: no copy until one
    is written; the arrays keep the file mapped while they live), hashed in place. Raises
    CheckpointError if the index disagrees with the file (a dataset moved or missing) and
    ChecksumError if bytes do not match their digest; the caller then reads through HDF5.
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
    hashing = pool("hash", hash_threads())
    try:
        for name in (o for o in index.others if selected(o)):
            item = f[name]
            arr = np.asarray(item[()])
            nbytes += arr.nbytes
            recorded = checksum.recorded_in(item.attrs)
            checks.append((name, hash_like(hashing, arr, recorded) if verify and recorded else None, recorded))
            parent, _, leaf = name.rpartition("/")
            node(parent)[leaf] = from_bits(arr, index.dtypes[name]) if name in index.dtypes else arr
        fd = os.open(path, os.O_RDONLY)
        try:
            view = _mapping(fd) if mapped else None
            for p in (p for p in index.placed if selected(p.name)):
                size = int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
                if view is not None and size and p.offset + size <= len(view):
                    arr = np.frombuffer(view, np.dtype(p.dtype), size // np.dtype(p.dtype).itemsize, p.offset)
                    arr = arr.reshape(p.shape)
                elif view is not None and size:  # past the end of the mapping would be SIGBUS
                    raise CheckpointError(f"{where}: dataset {p.name} lies past the end of the file; truncated")
                else:
                    arr = hostmem.empty(p.shape, np.dtype(p.dtype))  # 4 KiB pages: see hostmem
                if view is None and arr.nbytes and (
                        os.preadv(fd, [arr.reshape(-1).view(np.uint8).data], p.offset) != arr.nbytes):
                    raise CheckpointError(f"{where}: dataset {p.name} lies past the end of the file; truncated")
                nbytes += arr.nbytes
                checks.append((p.name, hash_like(hashing, arr, p.digest) if verify and p.digest else None, p.digest))
                parent, _, leaf = p.name.rpartition("/")
                node(parent)[leaf] = from_bits(arr, index.dtypes[p.name]) if p.name in index.dtypes else arr
        finally:
            os.close(fd)
        check_digests(checks, verify=verify, where=where)
    finally:  # nothing of this call still hashing when it returns, failed or not
        futures.wait([digest for _, digest, _ in checks if digest is not None])
    return {n: tree.get(n, {}) for n in names}, nbytes

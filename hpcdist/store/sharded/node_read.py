"""The whole state of a sharded checkpoint on every rank, each byte read and verified once per node.

``ctx.checkpoints.load_latest()`` gives every rank the whole state (the README's resume). A reader
per rank (DCP's, or hpcdist's before) reads, checks and holds every byte once per rank. Here every
rank maps the shard files copy-on-write (``MAP_PRIVATE``; ``torch.load(mmap=True)`` and safetensors
load the same way): its tensors are views of the node's page cache, which holds each byte once,
read from storage once. The ranks of a node split the checking (`replicas.owners`, largest first):
each hashes its share through its mapping, which pulls the bytes in (``MADV_WILLNEED`` first), and
no rank returns before every share verified. A rank that writes into a tensor (an optimizer's step)
gets its own pages then; one that copies it (``load_state_dict``) never makes another.

What that costs a user: the tensors keep their shard files mapped while they live (an optimizer's
moments, on a CPU, until they are replaced), so a pruned step's blocks are freed, and on NFS its
``.purge-`` folder is deleted, only then; and a page the kernel drops and reads again between the
check and a rank's first touch is not checked again. Where a file cannot be mapped every rank
reads what it holds itself (``preadv``, verified by that rank), and says so. Small tensors, the
values and tensors saved in pieces (FSDP) each rank reads and checks itself. A chunk that does not
match its digest fails the load on every rank with the same one-line error; every outcome is
agreed on the group in one ``all_gather`` of fixed-size tensors (no pickle).

The state comes back nested as DCP's planner data spells it, with the dict keys and empty dicts
DCP's flattening loses put back from the index's record (``sharded_layout.restore_keys``).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdist.errors import CheckpointError
from hpcdist.store import checksum, hostmem
from hpcdist.store.checkpoint import owned, values
from hpcdist.store.checkpoint.collective import agree, local_ranks
from hpcdist.store.checkpoint.tree import as_tensor, hash_like, hash_threads, pool, typed
from hpcdist.store.sharded.layout import (
    KEYS_ATTR,
    Chunk,
    Piece,
    TensorEntry,
    _nbytes,
    folder_of,
    open_shard,
    read_chunk,
    read_index,
    restore_keys,
    tensors_of,
)
from hpcdist.store.sharded.replicas import owners

SMALL_BYTES = 1 << 20  # smaller: each rank reads its copy (in runs) and hashes it inline; larger: mapped
RUN_BYTES = 8 << 20  # small chunks read together, at most
RUN_GAP_BYTES = 64 << 10  # small chunks this close in a file are read with one preadv
OK, NO_MAPPING, CORRUPT = 0, 1, 2


@dataclass
class ReadStats:
    """What one rank did to load a checkpoint's whole state."""

    path: Path
    bytes: int = 0  # the state's tensors and values, as stored
    bytes_read: int = 0  # read from the checkpoint's files and verified by this rank
    node_ranks: int = 1  # the ranks of its node that split the checking (1: this rank checked all it holds)
    seconds: float = 0.0
    fallback: str = ""  # why the files were not mapped, when they were not

    def describe(self) -> str:
        how = (f"verified once on its node of {self.node_ranks} ranks" if self.node_ranks > 1 else
               f"read alone ({self.fallback})" if self.fallback else "verified by this rank alone")
        return (f"checkpoint {self.path} loaded: {self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s, "
                f"{self.bytes_read / 1e6:.1f} MB of it read and verified by this rank, {how}")


class Sharing:
    """A group's ranks by node for `read_state`: found at the first read (a collective) and kept."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.ranks: tuple[int, ...] | None = None

    def read(self, index: Path | str, loaded: Any = None, own: bool = False) -> tuple[dict[str, Any], ReadStats]:
        """`read_state` of `index` (read already as `loaded`) on every rank of the group."""
        if self.group is not None and self.ranks is None:
            self.ranks = local_ranks(self.group)
        return read_state(index, group=self.group, node=self.ranks, loaded=loaded, own=own)


def read_state(index: Path | str, *, group: Any = None, node: tuple[int, ...] | None = None,
               keys: list[str] | None = None, loaded: Any = None,
               own: bool = False) -> tuple[dict[str, Any], ReadStats]:
    """The whole state of the sharded checkpoint `index` and what this rank did for it. With
    `group` (a collective: every rank calls it) the ranks in `node` (group ranks on this host,
    `local_ranks`) split the checking; with `keys`, only those entries (top-level names, or
    flattened ones) are read; `loaded`: the index file as ``checkpoints.read`` gave it already
    (the caller checked it). `own` (a resume): the shards are read through the checkpoint folder
    held open and checked, and must be this user's own (``layout.open_shard``); a refusal is a
    failed read that every rank agrees on."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    index = Path(index)
    rank = dist.get_rank(group) if group is not None else 0
    attrs, text = read_index(index, loaded)
    reader = _Reader(index, attrs, text, keys, rank, own)
    ranks = node if node and group is not None else (rank,)
    stats = reader.stats
    stats.bytes = sum(t.nbytes for t in reader.tensors.values()) + sum(_nbytes(c) for _, c in reader.values)
    mapped = [f for f, t in reader.tensors.items() if t.mappable and t.nbytes >= SMALL_BYTES]
    owner = owners([(f, reader.tensors[f].nbytes) for f in mapped], len(ranks))
    what = f"reading {index}"
    try:  # the same collectives on every rank of the group, whatever its node
        first = reader.map(mapped, {f for f in mapped if ranks[owner[f]] == rank})
        rest = reader.private([f for f in reader.tensors if f not in mapped])
        outcome = agree(group, *max(first, rest), what)  # CORRUPT over NO_MAPPING over OK
        _raise_corrupt(outcome)
        fallback = next((m for s, m in outcome if s == NO_MAPPING), "")
        if fallback:  # someone's share went unchecked: every rank reads what it holds itself
            _raise_corrupt(agree(group, *reader.private(mapped), what))
            stats.fallback = fallback
        elif mapped:
            stats.node_ranks = len(ranks)
    finally:
        reader.close()
    state = reader.state()
    stats.seconds = time.perf_counter() - t0
    return state, stats


def _raise_corrupt(outcome: list[tuple[int, str]]) -> None:
    for status, message in outcome:
        if status == CORRUPT:
            raise CheckpointError(message)


@dataclass
class _Tensor:
    fqn: str
    entry: TensorEntry
    stored: np.dtype[Any]  # the dtype its chunks hold (a bfloat16's bits as uint16)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.size)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.stored.itemsize

    @property
    def whole(self) -> Chunk | None:
        """Its one chunk, when it was saved in one (a replicated tensor), else None."""
        pieces = self.entry.pieces
        return pieces[0].chunk if len(pieces) == 1 and tuple(pieces[0].sizes) == self.shape else None

    @property
    def mappable(self) -> bool:
        return self.whole is not None and self.whole.offset >= 0 and self.nbytes > 0

    def tensor(self, arr: np.ndarray) -> Any:
        return as_tensor(typed(arr.reshape(self.shape), self.entry.dtype))


class _Reader:
    """One rank's reads of one checkpoint: what it holds (`flat`), what it checks, what it read."""

    def __init__(self, index: Path, attrs: dict[str, Any], text: str, keys: list[str] | None, rank: int,
                 own: bool = False) -> None:
        self.index, self.folder, self.rank, self.attrs = index, folder_of(index), rank, attrs
        self.own, self.held = own, contextlib.ExitStack()  # the checkpoint folder, held while shards are opened
        self.source: Path | None = None  # the shard folder through it, once held
        data = json.loads(text)
        self.paths: dict[str, tuple[Any, ...]] = {k: tuple(v) for k, v in (data.get("planner_data") or {}).items()}
        wanted = (lambda fqn: True) if keys is None else (lambda fqn: _wanted(fqn, self.paths.get(fqn, ()), keys))
        self.tensors: dict[str, _Tensor] = {}
        for fqn, entry in tensors_of(text).items():
            if wanted(fqn) and entry.pieces:
                self.tensors[fqn] = _Tensor(fqn, entry, np.dtype(entry.pieces[0].chunk.dtype))
        self.values = [(fqn, Chunk.from_record(c)) for fqn, offset, _, c in data["chunks"]
                       if offset is None and fqn in set(data["bytes"]) and wanted(fqn)]
        self.flat: dict[str, Any] = {}
        self.fds: dict[str, int] = {}  # shard files open for this load
        self.maps: dict[str, mmap.mmap] = {}  # and mapped (the tensors keep them; `close` lets them go)
        self.stats = ReadStats(index)
        self.hashing = pool("hash", hash_threads())

    def _check(self, checks: list[tuple[Chunk, str, Future[str]]]) -> str:
        """The first mismatch among `checks` (every digest waited for), or ""."""
        bad = ""
        for chunk, what, digest in checks:
            if digest.result() != chunk.digest and not bad:
                bad = (f"{self.folder / chunk.file}: {what} (dataset {chunk.dataset}, written by rank {chunk.rank}) "
                       f"does not match its {checksum.algorithm_of(chunk.digest)} checksum; read by rank "
                       f"{self.rank}: the file is corrupt")
        return bad

    def _shards(self) -> Path | None:
        """Where a resume opens the shard files: the shard folder through the held checkpoint folder."""
        if self.own and self.source is None:
            try:
                self.source = self.held.enter_context(owned.held(self.index.parent)) / self.folder.name
            except OSError as exc:
                raise CheckpointError(f"{self.index.parent}: cannot open it: {exc.strerror or exc} "
                                      f"(read by rank {self.rank})") from exc
        return self.source

    def _source(self, chunk: Chunk) -> int:
        """The shard file `chunk` lies in, opened once per load (`close`)."""
        if chunk.file not in self.fds:
            path = self.folder / chunk.file
            try:
                self.fds[chunk.file] = open_shard(self.folder, chunk.file, self._shards())
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read it (written by rank {chunk.rank}): {exc.strerror or exc} "
                                      f"(read by rank {self.rank})") from exc
        return self.fds[chunk.file]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.maps.clear()
        self.held.close()

    def _pread(self, chunk: Chunk, into: np.ndarray, at: int) -> None:
        got = os.preadv(self._source(chunk), [into.reshape(-1).view(np.uint8).data], at) if into.nbytes else 0
        if got != into.nbytes:
            raise CheckpointError(f"{self.folder / chunk.file}: dataset {chunk.dataset} (written by rank {chunk.rank}) "
                                  f"lies past the end of the file; truncated (read by rank {self.rank})")

    def _chunk(self, chunk: Chunk, what: str, checks: list[tuple[Chunk, str, Future[str]]]) -> np.ndarray:
        arr = hostmem.empty(tuple(chunk.shape), np.dtype(chunk.dtype))
        if chunk.offset >= 0:
            self._pread(chunk, arr, chunk.offset)
        else:  # an empty array: through HDF5
            arr = read_chunk(self.folder, chunk, what, source=self._shards())
        self.stats.bytes_read += arr.nbytes
        checks.append((chunk, what, self._hash(arr, chunk)))
        return arr

    def _small(self, items: list[tuple[str, Chunk]], checks: list[tuple[Chunk, str, Future[str]]]) -> list[np.ndarray]:
        """Small chunks (`items`: what, chunk), read in runs of neighbours: one ``preadv`` for many,
        each then copied out and hashed here (a thread's hand-off costs more than their hashing)."""
        out: list[np.ndarray] = [np.empty(0)] * len(items)
        order = sorted(range(len(items)), key=lambda i: (items[i][1].file, items[i][1].offset))
        run: list[int] = []

        def flush() -> None:
            first, last = items[run[0]][1], items[run[-1]][1]
            buf = np.empty(last.offset + _nbytes(last) - first.offset, dtype=np.uint8)
            self._pread(first, buf, first.offset)
            self.stats.bytes_read += sum(_nbytes(items[i][1]) for i in run)
            for i in run:
                what, c = items[i]
                at = c.offset - first.offset
                arr = buf[at:at + _nbytes(c)].view(np.dtype(c.dtype)).reshape(c.shape).copy()
                checks.append((c, what, self._hash(arr, c)))
                out[i] = arr
            run.clear()

        for i in order:
            c = items[i][1]
            if run:
                first, last = items[run[0]][1], items[run[-1]][1]
                if (c.file != first.file or c.offset - (last.offset + _nbytes(last)) > RUN_GAP_BYTES
                        or c.offset + _nbytes(c) - first.offset > RUN_BYTES):
                    flush()
            run.append(i)
        if run:
            flush()
        return out

    def private(self, fqns: list[str]) -> tuple[int, str]:
        """Read and check the tensors `fqns` (and, the first time, the plain values) in this process."""
        checks: list[tuple[Chunk, str, Future[str]]] = []
        try:
            small: list[tuple[str, Chunk]] = []
            for fqn in fqns:
                t = self.tensors[fqn]
                whole = t.whole
                if whole is not None and whole.offset >= 0 and t.nbytes < SMALL_BYTES:
                    small.append((fqn, whole))
                elif whole is not None:
                    self.flat[fqn] = t.tensor(self._chunk(whole, f"tensor {fqn}", checks))
                else:
                    full = hostmem.empty(t.shape, t.stored)
                    for p in t.entry.pieces:
                        full[_slices(p)] = self._chunk(p.chunk, f"tensor {fqn}", checks).reshape(p.sizes)
                    self.flat[fqn] = t.tensor(full)
            todo = [(fqn, c) for fqn, c in self.values if fqn not in self.flat and c.offset >= 0]
            arrays = self._small([(f"tensor {fqn}", c) for fqn, c in small] + [(f"value {fqn}", c) for fqn, c in todo],
                                 checks)
            for (fqn, _), arr in zip(small, arrays, strict=False):
                self.flat[fqn] = self.tensors[fqn].tensor(arr)
            raw = list(zip(todo, arrays[len(small):], strict=True))
            raw += [((fqn, c), self._chunk(c, f"value {fqn}", checks))
                    for fqn, c in self.values if fqn not in self.flat and c.offset < 0]
        except CheckpointError as exc:
            return CORRUPT, str(exc)
        finally:
            bad = self._check(checks)
        if bad:
            return CORRUPT, bad
        for (fqn, c), arr in raw:
            where = f"{self.folder / c.file}: entry {fqn}"
            self.flat[fqn] = (values.from_json(arr, where) if c.encoding == values.ENCODING
                              else values.unpickle_data(arr.tobytes(), where))  # format 1: as data only
        return OK, ""


    def _mapping(self, chunk: Chunk) -> mmap.mmap:
        """The shard file `chunk` lies in, mapped copy-on-write once per load."""
        if chunk.file not in self.maps:
            fd = self._source(chunk)
            size = os.fstat(fd).st_size
            self.maps[chunk.file] = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m = self.maps[chunk.file]
        if chunk.offset + _nbytes(chunk) > len(m):  # past the end it would be SIGBUS, not an error
            raise CheckpointError(f"{self.folder / chunk.file}: dataset {chunk.dataset} (written by rank {chunk.rank}) "
                                  f"lies past the end of the file; truncated (read by rank {self.rank})")
        return m

    def map(self, fqns: list[str], verify: set[str]) -> tuple[int, str]:
        """Tensors `fqns` as views of their files' pages; the ones in `verify` checked by this rank."""
        checks: list[tuple[Chunk, str, Future[str]]] = []
        try:
            for fqn in sorted(fqns, key=lambda f: f not in verify):  # this rank's share first: its reads start
                t = self.tensors[fqn]
                chunk = t.whole
                assert chunk is not None
                try:
                    m = self._mapping(chunk)
                except OSError as exc:
                    return NO_MAPPING, f"rank {self.rank} cannot map {self.folder / chunk.file}: {exc.strerror or exc}"
                arr = np.frombuffer(m, dtype=np.uint8, count=t.nbytes, offset=chunk.offset)
                if fqn in verify:
                    page = chunk.offset - chunk.offset % mmap.PAGESIZE
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        m.madvise(mmap.MADV_WILLNEED, page, chunk.offset + t.nbytes - page)
                    self.stats.bytes_read += t.nbytes
                    checks.append((chunk, f"tensor {fqn}", self._hash(arr, chunk)))
                self.flat[fqn] = t.tensor(arr.view(t.stored))  # the tensor keeps the mapping
        except CheckpointError as exc:
            return CORRUPT, str(exc)
        finally:
            bad = self._check(checks)
        return (CORRUPT, bad) if bad else (OK, "")

    def _hash(self, arr: np.ndarray, chunk: Chunk) -> Future[str]:
        if arr.nbytes >= SMALL_BYTES:  # a thread's hand-off costs more than a small hash
            return hash_like(self.hashing, arr, chunk.digest)
        done: Future[str] = Future()
        done.set_result(checksum.digest_like(arr, chunk.digest))
        return done

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint._traverse import set_element

        state: dict[str, Any] = {}
        for fqn, value in self.flat.items():
            set_element(state, self.paths.get(fqn, (fqn,)), value)
        restore_keys(state, str(self.attrs.get(KEYS_ATTR, "")))
        return state


def _slices(p: Piece) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes, strict=True))


def _wanted(fqn: str, path: tuple[Any, ...], keys: list[str]) -> bool:
    """DCP's rule (``_EmptyStateDictLoadPlanner``): `fqn` itself, or any of its path's prefixes, named."""
    if fqn in keys:
        return True
    prefix = ""
    for step in path:
        prefix = f"{prefix}.{step}" if prefix else str(step)
        if prefix in keys:
            return True
    return False

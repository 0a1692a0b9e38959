"""DCP's ``StorageWriter`` / ``StorageReader`` for hpcdist's sharded checkpoints (``hpcdist.store.sharded.checkpoint``):
each rank writes its own HDF5 file, the coordinator commits the index; reads verify each chunk."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from hpcdist.errors import CheckpointError
from hpcdist.files.atomic import atomic_path
from hpcdist.store import checksum
from hpcdist.store.checkpoint import owned, values
from hpcdist.store.checkpoint import single as checkpoints
from hpcdist.store.checkpoint.rawio import write_tree
from hpcdist.store.checkpoint.tree import hash_like, hash_threads, pool, tensor_array
from hpcdist.store.sharded.layout import (
    LAYOUT,
    LAYOUT_ATTR,
    SHARD_FORMAT,
    WINDOW_BYTES,
    Chunk,
    _as_tensor,
    _host,
    _key,
    _rank,
    folder_of,
    metadata_from_json,
    metadata_to_json,
    read_chunk,
    read_index,
    remove_orphans,
    shards_dir,
)

# ---------------------------------------------------------------- writing


class ShardedWriter(StorageWriter):
    """Each rank writes its own HDF5 file of `directory`'s step `step`; the coordinator commits.

    `attrs` become root attributes of the index (the commit's metadata: the requeue count, a run
    identity), `keep_last` the retention applied once committed. `stats` is the coordinator's
    `SaveStats` once `finish` committed: the bytes of every rank's shard file and of the index
    together, and the seconds from the writer's making (the save's start) to the commit.
    """

    def __init__(self, directory: Path | str, step: int, *, epoch: int = 0, attrs: Mapping[str, Any] | None = None,
                 keep_last: int | None = None, identity: Callable[[], Mapping[str, Any]] | None = None,
                 tree: Mapping[str, Any] | None = None, algorithm: str | None = None) -> None:
        """`identity`: the coordinator's commit identity (``CheckpointStore.commit_identity``: the run,
        the writer's job, the claim's check), asked for once in ``prepare_global_plan``, before any rank
        writes (a new run sets the earlier run's files aside then), so a failure there reaches every
        rank through DCP. `tree`: groups the coordinator writes into the index beside ``/sharded`` (a
        store tree of small values a reader wants without the shards: a trainer's sampler, tokenizer);
        `algorithm`: the checksum of every chunk (``hpcdist.store.checksum.chosen()`` by default)."""
        super().__init__()
        self.directory, self.step, self.epoch = Path(directory), int(step), int(epoch)
        self.attrs, self.keep_last = dict(attrs or {}), keep_last
        self.checksum = checksum.check_name(algorithm) if algorithm else checksum.chosen()
        self.tree = dict(tree or {})
        if "sharded" in self.tree:
            raise ValueError("the index's extra tree may not have a group named sharded: the index's own")
        self.identity = identity
        self._identity: dict[str, Any] | None = None  # asked for once, at planning
        self.folder = shards_dir(self.directory, self.step)
        self.is_coordinator = False
        self.started = time.perf_counter()  # the save's start: a writer is made for each save
        self.stats: checkpoints.SaveStats | None = None
        self.differing: list[tuple[str, ...]] = []  # values this rank wrote though the ranks' copies differ

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.stats = None
        self._identity = None
        self.started = time.perf_counter()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        attempt = self.begin()
        return [replace(plan, storage_data=(attempt, i)) for i, plan in enumerate(plans)]

    def begin(self) -> str:
        """The coordinator's start of a save, before any rank writes: the attempt's name (one per
        save: a failed save never overwrites a committed file) and the commit's identity, asked for
        now so that a new run sets the earlier run's files aside (shard folders included) before
        this save's shards go into a folder of theirs."""
        if self.identity is not None:
            self._identity = dict(self.identity())
        return uuid.uuid4().hex[:8]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        import h5py

        attempt, rank = plan.storage_data
        name = f"r{rank:05d}-{attempt}.h5"
        final = self.folder / name
        tree: dict[str, dict[str, Any]] = {"tensors": {}, "values": {}}
        where: list[tuple[Any, str, np.ndarray, str]] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:  # a value DCP would pickle: JSON instead (`values`)
                lookup = getattr(planner, "lookup_object", None)
                if lookup is None:
                    raise CheckpointError(f"the save planner {type(planner).__name__} cannot give the value "
                                          f"{item.index.fqn} itself; use DCP's default planner")
                arr = np.frombuffer(values.to_json(lookup(item.index), item.index.fqn), dtype=np.uint8)
                tree["values"][_key(item.index)] = arr
                where.append((item.index, f"/values/{_key(item.index)}", arr, ""))
            else:
                data = _host(planner.resolve_data(item))  # type: ignore[arg-type]  # a tensor item: a tensor
                arr = tensor_array(data)  # as the store writes it (the bits of a bfloat16), no copy
                offsets = "_".join(str(o) for o in item.index.offset or ()) or "0"
                tree["tensors"].setdefault(_key(item.index), {})[offsets] = data
                where.append((item.index, f"/tensors/{_key(item.index)}/{offsets}", arr, str(data.dtype)))
        try:
            owned.make_folder(self.folder)  # no group or world write: a resume reads only what no one else wrote
            with atomic_path(final) as tmp:
                f = h5py.File(tmp, "w", libver=checkpoints.LIBVER, meta_block_size=checkpoints.META_BLOCK_BYTES)
                try:
                    f.attrs.update({"format": SHARD_FORMAT, "format_version": checkpoints.FORMAT_VERSION,
                                    "step": self.step, "rank": rank, "attempt": attempt,
                                    checkpoints.CHECKSUM_ATTR: self.checksum})
                    index = write_tree(f, tree, raw=tmp, algorithm=self.checksum)
                finally:
                    f.close()
                owned.drop_group_write(tmp)
                size = tmp.stat().st_size
        except Exception as exc:
            raise CheckpointError(
                f"rank {rank} writing its shard {final} of step {self.step} failed: {type(exc).__name__}: {exc}; "
                "nothing of this save is committed and the previous checkpoint stays the latest") from exc
        placed = {p.name: p for p in index.placed}  # the rest (empty arrays) is read through HDF5

        def chunk(path: str, arr: np.ndarray, torch_dtype: str) -> Chunk:
            p = placed.get(path)
            return Chunk(name, rank, path, p.offset if p else -1, arr.dtype.str, tuple(arr.shape), torch_dtype,
                         p.digest if p else checksum.digest(arr, self.checksum),
                         "" if torch_dtype else values.ENCODING)

        # each item's bytes in the file, the file's own (HDF5's headers, the index) with its first
        # item: the results' sizes add up to the file's, which reaches the coordinator with them
        overhead = size - sum(arr.nbytes for _, _, arr, _ in where)
        results = [WriteResult(index=idx, size_in_bytes=arr.nbytes + (overhead if i == 0 else 0),
                               storage_data=chunk(path, arr, tdt))
                   for i, (idx, path, arr, tdt) in enumerate(where)]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: the index written last, atomically, then retention; stray shard files removed."""
        chunks = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_data = chunks
        self.commit(metadata_to_json(metadata), sorted({c.file for c in chunks.values()}),
                    sum(r.size_in_bytes for rs in results for r in rs))

    def commit(self, text: str, files: list[str], shard_bytes: int = 0) -> None:
        """The index of the shards `files` with the metadata `text` (``sharded_layout``'s JSON),
        written last, atomically, then retention; stray shard files removed. `shard_bytes`: the
        shard files' sizes together (every rank's), counted in `stats` with the index's."""
        tree = {**self.tree, "sharded": {
            "metadata_json": text, "metadata_sha256": hashlib.sha256(text.encode()).hexdigest(), "files": files,
            "folder": self.folder.name}}
        attrs = {**self.attrs, LAYOUT_ATTR: LAYOUT}
        identity = self._identity if self._identity is not None else (
            dict(self.identity()) if self.identity is not None else {})
        before = time.perf_counter() - self.started  # the shards' part; the index's is its stats' seconds
        stats = checkpoints.save(self.directory, self.step, tree, epoch=self.epoch, attrs=attrs,
                                 keep_last=self.keep_last, checksum=self.checksum, **identity)
        self.stats = replace(stats, bytes=stats.bytes + shard_bytes, seconds=before + stats.seconds)
        for stray in self.folder.iterdir():  # earlier failed attempts at this step, and their temporaries
            if stray.name not in files:
                stray.unlink(missing_ok=True)
        remove_orphans(self.directory, self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


# ---------------------------------------------------------------- reading


class ShardedReader(StorageReader):
    """Reads the committed sharded checkpoint `index` (a ``step_*.h5`` index file), each chunk
    verified against its digest before any of it is used.

    Every rank verifies every chunk it reads itself (XXH3-128 runs at memory speed: no rank uses
    bytes nobody checked, and no rank trusts another's verdict on bytes it read itself). Values
    come back as data: format 2's JSON, format 1's pickles only as ``torch.load(weights_only=True)``
    does (``hpcdist.store.checkpoint.values``); nothing in a checkpoint is unpickled in full.

    With `own` (a resume: the run's own checkpoint), the index and every shard are read through
    the checkpoint folder held open and checked (``owned.held``), each rank for the reads it does,
    and any of them that another user could have written is refused: DCP gathers that error, as
    any rank's, to every rank.
    """

    def __init__(self, index: Path | str, process_group: Any = None, *, own: bool = False) -> None:
        super().__init__()
        self.group = process_group
        self.index = Path(index)
        self.own = own
        self.folder = folder_of(self.index)
        self.attrs: dict[str, Any] = {}
        self._metadata: Metadata | None = None
        self.bytes_read = self.bytes_hashed = 0  # by this rank

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.__init__(Path(checkpoint_id), self.group, own=self.own)  # type: ignore[misc]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            if self.own:
                with owned.held(self.index.parent) as here:
                    why = owned.problem(here / self.index.name)
                    if why is not None:
                        raise CheckpointError(f"checkpoint {self.index}: {why}")
                    self.attrs, text = read_index(here / self.index.name)
            else:
                self.attrs, text = read_index(self.index)
            self._metadata = metadata_from_json(text)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read and verify this rank's chunks. A mismatch on any rank fails the load on every rank:
        DCP gathers every rank's ``read_data`` outcome (``_DistWrapper.all_gather("read", ...)``)."""
        if self.own:
            with owned.held(self.index.parent) as here:
                self._read_all(plan, planner, here / self.folder.name)
        else:
            self._read_all(plan, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner, source: Path | None = None) -> None:
        md = self.read_metadata()
        storage: dict[MetadataIndex, Chunk] = md.storage_data
        by_chunk: dict[MetadataIndex, list[Any]] = defaultdict(list)
        for req in plan.items:
            by_chunk[req.storage_index].append(req)
        # Read chunk k+1.. while chunk k is hashed (xxhash, hashlib and preadv release the GIL); a
        # chunk is committed only once its digest holds. At most WINDOW_BYTES (or one chunk) wait in memory.
        # A chunk that is exactly one target's tensor is read straight into it (no second copy): a
        # mismatch then leaves the state part-loaded, as any failed load does, and raises.
        window: deque[tuple[MetadataIndex, Any, np.ndarray, torch.Tensor | None]] = deque()
        held = 0
        hashing = pool("hash", hash_threads())
        try:
            for index, reqs in by_chunk.items():
                chunk = storage[index]
                target = self._whole_target(chunk, reqs, planner)
                into = None if target is None else target.reshape(-1).view(torch.uint8).numpy()
                arr = self._read_chunk(chunk, index.fqn, into, source)
                self.bytes_hashed += arr.nbytes
                window.append((index, hash_like(hashing, arr, chunk.digest), arr, target))
                held += arr.nbytes
                while window and (held > WINDOW_BYTES or len(window) > hash_threads()):
                    held -= self._use(*window.popleft(), by_chunk, planner)
            while window:
                self._use(*window.popleft(), by_chunk, planner)
        finally:  # nothing of this load still hashing when it returns, failed or not
            futures.wait([w[1] for w in window if w[1] is not None])

    @staticmethod
    def _whole_target(chunk: Chunk, reqs: list[Any], planner: LoadPlanner) -> torch.Tensor | None:
        """The one target tensor that is exactly this chunk (same bytes, contiguous, in host memory)."""
        from torch.distributed.checkpoint.planner import LoadItemType

        if len(reqs) != 1 or reqs[0].type == LoadItemType.BYTE_IO or chunk.offset < 0 or not chunk.torch_dtype:
            return None
        req = reqs[0]
        if any(req.storage_offsets):
            return None
        target = planner.resolve_tensor(req).detach()
        ok = (target.device.type == "cpu" and target.is_contiguous() and str(target.dtype) == chunk.torch_dtype
              and tuple(target.shape) == tuple(req.lengths)  # no offset and all the bytes: the whole chunk
              and target.nbytes == int(np.prod(chunk.shape)) * np.dtype(chunk.dtype).itemsize)
        return target if ok else None

    def _use(self, index: MetadataIndex, digest: Any, arr: np.ndarray, whole: torch.Tensor | None,
             by_chunk: dict[MetadataIndex, list[Any]], planner: LoadPlanner) -> int:
        """Check one chunk's digest, then copy it into every target that wants part of it."""
        from torch.distributed.checkpoint.planner import LoadItemType

        md = self.read_metadata()
        chunk: Chunk = md.storage_data[index]
        if digest.result() != chunk.digest:
            raise CheckpointError(
                f"{self.folder / chunk.file}: {'tensor' if chunk.torch_dtype else 'value'} {index.fqn} (dataset "
                f"{chunk.dataset}, written by rank {chunk.rank}) does not match its "
                f"{checksum.algorithm_of(chunk.digest)} checksum; read by rank {_rank()}: the file is corrupt")
        if whole is not None:  # already in place
            planner.commit_tensor(by_chunk[index][0], whole)
            return arr.nbytes
        for req in by_chunk[index]:
            if req.type == LoadItemType.BYTE_IO:
                where = f"{self.folder / chunk.file}: entry {index.fqn}"
                value = (values.from_json(arr, where) if chunk.encoding == values.ENCODING
                         else values.unpickle_data(arr.tobytes(), where))  # format 1: DCP's pickle, as data only
                deliver(planner, req, value)
                continue
            meta = md.state_dict_metadata[index.fqn]
            sizes = next(c.sizes for c in meta.chunks if c.offsets == index.offset)  # type: ignore[union-attr]
            tensor = _as_tensor(arr, chunk, sizes)
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                if start != 0 or length != tensor.size(dim):
                    tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointError(f"{self.folder / chunk.file}: tensor {index.fqn} chunk has size "
                                      f"{tuple(tensor.size())}, the state wants {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        return arr.nbytes

    def _read_chunk(self, chunk: Chunk, fqn: str, into: np.ndarray | None = None,
                    source: Path | None = None) -> np.ndarray:
        """One chunk's bytes (into `into`, a byte view of its target, when given), not yet verified;
        `source`: the shard folder through the held checkpoint folder (``layout.open_shard``)."""
        arr = read_chunk(self.folder, chunk, f"tensor {fqn}", into, source)
        self.bytes_read += arr.nbytes
        return arr

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False




def deliver(planner: LoadPlanner, req: Any, value: Any) -> None:
    """Put a value read as data into the state, as DCP's ``DefaultLoadPlanner.load_bytes`` does but
    without its ``torch.load(weights_only=False)``."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if not isinstance(planner, DefaultLoadPlanner):
        raise CheckpointError(f"the load planner {type(planner).__name__} would unpickle the value "
                              f"{req.dest_index.fqn}; load hpcdist checkpoints with DCP's default planner "
                              "(hpcdist.store.sharded.checkpoint.load)")
    fqn = req.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value

"""Sharded checkpoints: ``torch.distributed.checkpoint``'s storage layer, writing hpcdist's HDF5.

`ShardedWriter` and `ShardedReader` implement DCP's ``StorageWriter`` / ``StorageReader``, so
DCP's planner decides what each rank writes (each replicated tensor once, by one rank) and
reads (only the chunks its own layout needs, at any mesh or world size). Layout of step 120:

- ``step_00000120.shards/r<rank:05d>-<attempt>.h5``: one HDF5 file per rank, written under a
  temporary name, fdatasynced, renamed (``hpcdist.store.atomic``). Its ``/tensors/<fqn>/<offsets>``
  datasets are the tensor chunks that rank saved (``<offsets>`` joined by ``_``), its
  ``/bytes/<fqn>`` the other values (DCP's ``torch.save`` bytes); each carries its ``sha256``.
  ``<attempt>`` is new at every save, so a save that dies never touches a committed file.
- ``step_00000120.h5``: the index, an ordinary ``hpcdist.checkpoint`` file (root attribute
  ``layout = "sharded"``) whose group ``/sharded`` holds ``metadata_json`` (every tensor's
  dtype, size and chunks, and for each chunk its file, dataset, byte offset and sha256) with its
  own ``metadata_sha256``, and ``files``. The coordinator writes it in ``finish``, after every
  rank's file is durable, through ``hpcdist.store.checkpoints.save``: the ``latest`` pointer,
  retention and discovery are the same as for unsharded checkpoints, and a crash of any rank
  before that leaves the previous commit the latest.

A reader reads each chunk it needs with one ``os.preadv`` and checks its sha256 first; a
mismatch is one CheckpointError naming the file, the tensor, the rank that wrote it and the
rank reading. The metadata is JSON, not a pickle, so ``h5dump`` shows all of it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from hpcdist.errors import CheckpointError
from hpcdist.store import checkpoints
from hpcdist.store.atomic import atomic_path
from hpcdist.store.directory import checkpoint_name, checkpoints_in, committed_in, step_of
from hpcdist.store.rawio import write_tree
from hpcdist.store.tree import hash_threads, sha256_of

LAYOUT_ATTR = "layout"  # root attribute of the index: "sharded"
LAYOUT = "sharded"
SHARD_FORMAT = "hpcdist.checkpoint.shard"
SUFFIX = ".shards"
WINDOW_BYTES = 64 << 20  # chunks read ahead of their hashing, at most (or one chunk)
# torch dtypes NumPy has; others (bfloat16, float8) are stored as their bytes (uint8, one more axis)
_NUMPY_OK = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
             torch.uint8, torch.bool, torch.complex64, torch.complex128}


def shards_dir(directory: Path, step: int) -> Path:
    """The folder of step `step`'s shard files, beside its index."""
    return Path(directory) / (checkpoint_name(step).removesuffix(".h5") + SUFFIX)


def is_sharded(attrs: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's root attributes are those of a sharded checkpoint's index."""
    return attrs.get(LAYOUT_ATTR) == LAYOUT


@dataclass(frozen=True)
class Chunk:
    """Where one saved chunk lies: what the index records per chunk (DCP's storage_data)."""

    file: str  # shard file name inside the step's folder
    rank: int  # the rank that wrote it
    dataset: str  # HDF5 path in that file
    offset: int  # byte offset of its contiguous data; -1: read it through HDF5
    dtype: str  # NumPy dtype as stored
    shape: tuple[int, ...]  # shape as stored
    torch_dtype: str  # "" for bytes
    sha256: str


def _key(index: MetadataIndex) -> str:
    return index.fqn.replace("%", "%25").replace("/", "%2F")


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype in _NUMPY_OK:
        return t.numpy()
    return t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()


def _as_tensor(arr: np.ndarray, chunk: Chunk, size: torch.Size) -> torch.Tensor:
    t = torch.from_numpy(arr)
    dtype = getattr(torch, chunk.torch_dtype.removeprefix("torch."))
    if t.dtype != dtype:
        t = t.reshape(-1).view(dtype)
    return t.reshape(size)


def _failure(exc: BaseException, what: str) -> CheckpointError:
    return exc if isinstance(exc, CheckpointError) else CheckpointError(f"{what}: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------- writing


class ShardedWriter(StorageWriter):
    """Each rank writes its own HDF5 file of `directory`'s step `step`; the coordinator commits.

    `attrs` become root attributes of the index (the commit's metadata: the requeue count, a run
    identity), `keep_last` the retention applied once committed. `stats` is the coordinator's
    `SaveStats` once `finish` committed.
    """

    def __init__(self, directory: Path | str, step: int, *, epoch: int = 0, attrs: Mapping[str, Any] | None = None,
                 keep_last: int | None = None) -> None:
        super().__init__()
        self.directory, self.step, self.epoch = Path(directory), int(step), int(epoch)
        self.attrs, self.keep_last = dict(attrs or {}), keep_last
        self.folder = shards_dir(self.directory, self.step)
        self.is_coordinator = False
        self.stats: checkpoints.SaveStats | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.stats = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        from dataclasses import replace

        attempt = uuid.uuid4().hex[:8]  # one per save: a failed save never overwrites a committed file
        return [replace(plan, storage_data=(attempt, i)) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        import h5py

        attempt, rank = plan.storage_data
        name = f"r{rank:05d}-{attempt}.h5"
        final = self.folder / name
        tree: dict[str, dict[str, Any]] = {"tensors": {}, "bytes": {}}
        where: list[tuple[Any, str, np.ndarray, str]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO):  # WriteItemType.BYTE_IO: a value DCP pickled
                arr = np.frombuffer(data.getbuffer(), dtype=np.uint8)
                tree["bytes"][_key(item.index)] = arr
                where.append((item.index, f"/bytes/{_key(item.index)}", arr, ""))
            else:
                arr = _as_numpy(data)
                offsets = "_".join(str(o) for o in item.index.offset or ()) or "0"
                tree["tensors"].setdefault(_key(item.index), {})[offsets] = arr
                where.append((item.index, f"/tensors/{_key(item.index)}/{offsets}", arr, str(data.dtype)))
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(final) as tmp:
                f = h5py.File(tmp, "w", libver=checkpoints.LIBVER, meta_block_size=checkpoints.META_BLOCK_BYTES)
                try:
                    f.attrs.update({"format": SHARD_FORMAT, "step": self.step, "rank": rank, "attempt": attempt})
                    index = write_tree(f, tree, raw=tmp)
                finally:
                    f.close()
        except Exception as exc:
            raise CheckpointError(
                f"rank {rank} writing its shard {final} of step {self.step} failed: {type(exc).__name__}: {exc}; "
                "nothing of this save is committed and the previous checkpoint stays the latest") from exc
        placed = {p.name: p for p in index.placed}  # the rest (empty arrays) is read through HDF5

        def chunk(path: str, arr: np.ndarray, torch_dtype: str) -> Chunk:
            p = placed.get(path)
            return Chunk(name, rank, path, p.offset if p else -1, arr.dtype.str, tuple(arr.shape), torch_dtype,
                         p.sha256 if p else sha256_of(arr))

        results = [WriteResult(index=idx, size_in_bytes=arr.nbytes, storage_data=chunk(path, arr, tdt))
                   for idx, path, arr, tdt in where]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: the index written last, atomically, then retention; stray shard files removed."""
        chunks = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_data = chunks
        text = metadata_to_json(metadata)
        files = sorted({c.file for c in chunks.values()})
        tree = {"sharded": {"metadata_json": text, "metadata_sha256": hashlib.sha256(text.encode()).hexdigest(),
                            "files": files, "folder": self.folder.name}}
        attrs = {**self.attrs, LAYOUT_ATTR: LAYOUT}
        self.stats = checkpoints.save(self.directory, self.step, tree, epoch=self.epoch, attrs=attrs,
                                      keep_last=self.keep_last)
        for stray in self.folder.iterdir():  # earlier failed attempts at this step, and their temporaries
            if stray.name not in files:
                stray.unlink(missing_ok=True)
        remove_orphans(self.directory, self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def remove_orphans(directory: Path, below: int) -> list[Path]:
    """Shard folders of steps older than `below` whose index is gone (pruned, or never committed)."""
    gone = []
    for folder in Path(directory).glob(f"step_*{SUFFIX}"):
        step = step_of(folder.with_name(folder.name.removesuffix(SUFFIX) + ".h5"))
        if step is not None and step < below and not folder.with_name(checkpoint_name(step)).exists():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


# ---------------------------------------------------------------- the index as JSON


def metadata_to_json(md: Metadata) -> str:
    tensors, plain = {}, []
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[fqn] = {"dtype": str(meta.properties.dtype), "size": list(meta.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks]}
        else:
            plain.append(fqn)
    storage = [[i.fqn, None if i.offset is None else list(i.offset), i.index, asdict(c)]
               for i, c in md.storage_data.items()]
    try:
        return json.dumps({"version": md.version, "tensors": tensors, "bytes": plain, "chunks": storage,
                           "planner_data": md.planner_data}, separators=(",", ":"))
    except TypeError as exc:
        raise CheckpointError(
            f"the planner's data of this checkpoint is not JSON ({exc}); use DCP's default planner") from exc


def metadata_from_json(text: str) -> Metadata:
    data = json.loads(text)
    sd: dict[str, Any] = {
        fqn: TensorStorageMetadata(TensorProperties(dtype=getattr(torch, t["dtype"].removeprefix("torch."))),
                                   torch.Size(t["size"]),
                                   [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]])
        for fqn, t in data["tensors"].items()
    }
    sd.update({fqn: BytesStorageMetadata() for fqn in data["bytes"]})
    storage = {MetadataIndex(fqn, offset, index): Chunk(**{**c, "shape": tuple(c["shape"])})
               for fqn, offset, index, c in data["chunks"]}
    planner = data["planner_data"]
    if isinstance(planner, dict):
        planner = {k: tuple(v) if isinstance(v, list) else v for k, v in planner.items()}
    return Metadata(sd, planner_data=planner, storage_data=storage, version=data["version"])


# ---------------------------------------------------------------- reading


class ShardedReader(StorageReader):
    """Reads the committed sharded checkpoint `index` (a ``step_*.h5`` index file), each chunk
    verified against its sha256 before any of it is used.

    With `process_group` (the group ``dcp.load`` is given: it must be the same), a chunk several
    ranks read (a replicated tensor) is hashed by one of them only, the ranks sharing the work by
    bytes, and the verdicts are exchanged before the load returns: a mismatch found by any rank
    fails the load on every rank. Without, every rank verifies everything it reads.
    """

    def __init__(self, index: Path | str, process_group: Any = None, *, split: bool = False) -> None:
        super().__init__()
        self.group, self.split = process_group, split
        self.index = Path(index)
        self.folder = self.index.with_name(self.index.name.removesuffix(".h5") + SUFFIX)
        self.attrs: dict[str, Any] = {}
        self._metadata: Metadata | None = None
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.__init__(Path(checkpoint_id), self.group, split=self.split)  # type: ignore[misc]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            loaded = checkpoints.read(self.index)  # format and version checked
            if not is_sharded(loaded.attrs):
                raise CheckpointError(f"{self.index}: not a sharded checkpoint (no {LAYOUT_ATTR} = {LAYOUT!r}); "
                                      "read it with hpcdist.store.read")
            group = loaded.tree.get("sharded", {})
            text = str(group.get("metadata_json", ""))
            if hashlib.sha256(text.encode()).hexdigest() != group.get("metadata_sha256"):
                raise CheckpointError(f"{self.index}: its metadata_json does not match its metadata_sha256; corrupt")
            self.attrs = loaded.attrs
            self._metadata = metadata_from_json(text)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """With `split`: each chunk's verifier, one of the ranks that read it, fewest bytes first."""
        if not self.split:
            return plans
        from dataclasses import replace

        storage: dict[MetadataIndex, Chunk] = self.read_metadata().storage_data
        readers: dict[MetadataIndex, list[int]] = defaultdict(list)
        for rank, plan in enumerate(plans):
            for index in dict.fromkeys(req.storage_index for req in plan.items):
                readers[index].append(rank)
        load = [0] * len(plans)
        mine: list[set[MetadataIndex]] = [set() for _ in plans]
        for index in sorted(readers, key=lambda i: -_nbytes(storage[i])):
            rank = min(readers[index], key=lambda r: load[r])
            load[rank] += _nbytes(storage[index])
            mine[rank].add(index)
        return [replace(plan, storage_data=mine[rank]) for rank, plan in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        error = ""
        try:
            self._read_all(plan, planner)
        except CheckpointError as exc:
            error = str(exc)
        if self.split:  # every rank reaches this exchange, failed or not
            import torch.distributed as dist

            errors: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(errors, error, group=self.group)
            error = next((e for e in errors if e), "")
        if error:
            raise CheckpointError(error)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        md = self.read_metadata()
        storage: dict[MetadataIndex, Chunk] = md.storage_data
        verify: set[MetadataIndex] | None = plan.storage_data if self.split else None  # None: all
        by_chunk: dict[MetadataIndex, list[Any]] = defaultdict(list)
        for req in plan.items:
            by_chunk[req.storage_index].append(req)
        # Read chunk k+1.. while chunk k is hashed (hashlib and preadv release the GIL); a chunk is
        # committed only once its sha256 holds. At most WINDOW_BYTES (or one chunk) wait in memory.
        # A chunk that is exactly one target's tensor is read straight into it (no second copy): a
        # mismatch then leaves the state part-loaded, as any failed load does, and raises.
        window: deque[tuple[MetadataIndex, Any, np.ndarray, torch.Tensor | None]] = deque()
        held = 0
        with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
            for index, reqs in by_chunk.items():
                chunk = storage[index]
                target = self._whole_target(chunk, reqs, planner)
                into = None if target is None else target.reshape(-1).view(torch.uint8).numpy()
                arr = self._read_chunk(chunk, index.fqn, into)
                checked = verify is None or index in verify  # else another rank hashes its own read
                window.append((index, pool.submit(sha256_of, arr) if checked else None, arr, target))
                held += arr.nbytes
                while window and (held > WINDOW_BYTES or len(window) > hash_threads()):
                    held -= self._use(*window.popleft(), by_chunk, planner)
            while window:
                self._use(*window.popleft(), by_chunk, planner)

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
        """Check one chunk's sha256, then copy it into every target that wants part of it."""
        from torch.distributed.checkpoint.planner import LoadItemType

        md = self.read_metadata()
        chunk: Chunk = md.storage_data[index]
        if digest is not None and digest.result() != chunk.sha256:
            raise CheckpointError(
                f"{self.folder / chunk.file}: tensor {index.fqn} (dataset {chunk.dataset}, written by rank "
                f"{chunk.rank}) does not match its sha256; read by rank {_rank()}: the file is corrupt")
        if whole is not None:  # already in place
            planner.commit_tensor(by_chunk[index][0], whole)
            return arr.nbytes
        for req in by_chunk[index]:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(arr.tobytes()))
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

    def _read_chunk(self, chunk: Chunk, fqn: str, into: np.ndarray | None = None) -> np.ndarray:
        """One chunk's bytes (into `into`, a byte view of its target, when given), not yet verified."""
        path = self.folder / chunk.file
        try:
            if chunk.offset >= 0:
                arr = into if into is not None else np.empty(chunk.shape, dtype=np.dtype(chunk.dtype))
                fd = os.open(path, os.O_RDONLY)
                try:
                    got = os.preadv(fd, [arr.reshape(-1).view(np.uint8).data], chunk.offset) if arr.nbytes else 0
                finally:
                    os.close(fd)
                if got != arr.nbytes:
                    raise CheckpointError(f"{path}: tensor {fqn} (written by rank {chunk.rank}) lies past the end "
                                          f"of the file; truncated (read by rank {_rank()})")
            else:
                import h5py

                with h5py.File(path, "r") as f:
                    arr = np.asarray(f[chunk.dataset][()])
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read tensor {fqn} (written by rank {chunk.rank}): "
                                  f"{exc.strerror or exc} (read by rank {_rank()})") from exc
        self.bytes_read += arr.nbytes
        return arr

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _nbytes(chunk: Chunk) -> int:
    return int(np.prod(chunk.shape)) * np.dtype(chunk.dtype).itemsize


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------- whole-checkpoint calls


def error_of(exc: BaseException) -> CheckpointError:
    """One CheckpointError from DCP's CheckpointException: the first rank's own message."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        for rank, (inner, _) in sorted(exc.failures.items()):
            if isinstance(inner, CheckpointError):
                return inner
            text = str(inner).strip().splitlines()[-1] if str(inner).strip() else type(inner).__name__
            if "global metadata read failed: " in text:  # DCP's words for an index read_metadata refused
                return CheckpointError(text.split("global metadata read failed: ", 1)[1])
            return CheckpointError(f"rank {rank}: {type(inner).__name__}: {text}")
    return _failure(exc, "sharded checkpoint")


def save(directory: Path | str, step: int, state: dict[str, Any], *, process_group: Any = None,
         attrs: Mapping[str, Any] | None = None, keep_last: int | None = None,
         epoch: int = 0) -> checkpoints.SaveStats | None:
    """Every rank of `process_group` saves its part of `state`; committed once. The coordinator's
    SaveStats (None on other ranks)."""
    writer = ShardedWriter(directory, step, epoch=epoch, attrs=attrs, keep_last=keep_last)
    save_with(state, writer, process_group)
    return writer.stats


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def save_with(state: dict[str, Any], writer: ShardedWriter, process_group: Any = None) -> None:
    """`save` through a given writer: every rank returns once committed, or raises the same error."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=_no_dist())
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise error_of(exc) from exc


class Stager(AsyncStager):
    """The host copy a background save blocks for, made into the previous save's buffers when the
    state has the same layout (no fresh pages to fault in, as `rawio.snapshot`'s `reuse`). Use one
    per run and wait for a save before staging the next: the buffers are the save's source."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: Any = None
        self._layout: Any = None

    def synchronize_staging(self) -> None:  # staging is done when `stage` returns
        return None

    def close(self) -> None:
        self._cache = self._layout = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        if self._cache is None or layout != self._layout:
            self._cache, self._layout = _create_cpu_state_dict(state_dict), layout
        return _copy_state_dict(state_dict, self._cache)


def _layout(value: Any) -> Any:
    """What must match for a staged copy to be reused: keys, and each tensor's local shape and dtype."""
    if isinstance(value, Mapping):
        return tuple((k, _layout(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(_layout(v) for v in value)
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return (type(value).__name__, tuple(local.shape), local.dtype, tuple(value.shape))
    return type(value).__name__


def save_async(state: dict[str, Any], writer: ShardedWriter, process_group: Any = None,
               stager: Stager | None = None) -> Any:
    """`save_with` in the background: returns once this rank's shards are copied to host memory;
    `wait` on the returned future gives the outcome (the same on every rank). The group's
    collectives then run in a thread: nothing else may use `process_group` until `wait` returned."""
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.async_save(state, storage_writer=writer, process_group=process_group, no_dist=_no_dist(),
                              async_stager=stager)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise error_of(exc) from exc


def wait(future: Any) -> None:
    """The outcome of `save_async`: returns once committed, or raises its CheckpointError."""
    try:
        future.result()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise error_of(exc) from exc


def load(index: Path | str, state: dict[str, Any], *, process_group: Any = None) -> dict[str, Any]:
    """Fill `state` (any layout) in place from the sharded checkpoint `index`; its root attributes."""
    import torch.distributed.checkpoint as dcp

    reader = ShardedReader(index, process_group, split=not _no_dist())
    try:
        dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=_no_dist())
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise error_of(exc) from exc
    reader.read_metadata()
    return reader.attrs


def read_full(index: Path | str) -> dict[str, Any]:
    """The whole state of a sharded checkpoint in this process (every tensor full, no process group)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, ShardedReader(index), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise error_of(exc) from exc
    return state


def load_latest(directory: Path | str, state: dict[str, Any], *, steps: list[int] | None = None,
                process_group: Any = None, report: Callable[[str], None] | None = None) -> int | None:
    """Fill `state` from the newest of `steps` (by default the committed ones) that loads and
    verifies; its step, or None. Every rank must pass the same `steps`: a failure on one rank
    reaches all through DCP's collectives, so all move on to the same older step."""
    directory = Path(directory)
    if steps is None:
        steps = [step_of(p) or 0 for p in committed_in(directory)]
    for step in steps:
        try:
            load(directory / checkpoint_name(step), state, process_group=process_group)
            return step
        except CheckpointError as exc:
            if report is not None:
                report(f"skipped step {step}: {exc}")
    return None


def import_dcp(source: Path | str, directory: Path | str, step: int, **kw: Any) -> checkpoints.SaveStats | None:
    """A ``dcp.save`` folder (``FileSystemWriter``) as step `step` of hpcdist checkpoint `directory`
    (in one process: the whole state passes through its memory)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, FileSystemReader(str(source)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return save(directory, step, state, **kw)


def export_dcp(index: Path | str, target: Path | str) -> None:
    """A sharded checkpoint written as a ``dcp.save`` folder (``FileSystemWriter``), for DCP's users."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(read_full(index), storage_writer=FileSystemWriter(str(target)), no_dist=True)


__all__ = ["Chunk", "ShardedReader", "ShardedWriter", "checkpoints_in", "export_dcp", "import_dcp", "is_sharded",
           "load", "load_latest", "read_full", "save", "Stager", "save_async", "save_with", "shards_dir", "wait"]

"""The layout of a sharded checkpoint (``hpcdist.store.sharded.checkpoint``): names, the per-chunk record
(`Chunk`), dtypes as stored, the index's metadata as JSON (never a pickle), reading one chunk,
and retention of shard folders.

torch is imported only where DCP's objects are made (`metadata_from_json`, `metadata_to_json`):
the index read as plain records (`read_index`, `tensors_of`) is what a login node checks an
inference spec against, without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint import owned
from hpcdist.store.checkpoint.directory import checkpoint_name, step_of
from hpcdist.store.checkpoint.tree import as_tensor, pool, typed

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

LAYOUT_ATTR = "layout"  # root attribute of the index: "sharded"
LAYOUT = "sharded"
SHARD_FORMAT = "hpcdist.checkpoint.shard"
SUFFIX = ".shards"
PURGE_MARK = ".purge-"  # a shard folder renamed for deletion in the background (`remove_orphans`)
WINDOW_BYTES = 64 << 20  # chunks read ahead of their hashing, at most (or one chunk)
KEYS_ATTR = "keys_json"  # root attribute of the index: the dict keys and empty dicts DCP's flattening loses


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
    dtype: str  # NumPy dtype as stored: a dtype NumPy lacks (bfloat16) as its bits (``hpcdist.store.checkpoint.tree``)
    shape: tuple[int, ...]  # shape as stored: the tensor chunk's own
    torch_dtype: str  # the chunk's torch dtype ("torch.bfloat16"); "" for a value
    digest: str  # as recorded (``hpcdist.store.checksum``): "xxh3-128:<hex>", or format 1's bare sha256
    encoding: str = ""  # a value's: "json" (``hpcdist.store.checkpoint.values``); "" for a tensor, or format 1's pickle

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Chunk:
        """A chunk from the index's JSON record (format 1 named its digest ``sha256``)."""
        fields = dict(record)
        if "sha256" in fields:
            fields["digest"] = fields.pop("sha256")
        return cls(**{**fields, "shape": tuple(fields["shape"])})


def folder_of(index: Path) -> Path:
    """The shard folder of the committed index file `index` (``step_*.h5``)."""
    return index.with_name(index.name.removesuffix(".h5") + SUFFIX)


def read_index(index: Path, loaded: Any = None) -> tuple[dict[str, Any], str]:
    """The root attributes and the metadata JSON of the sharded checkpoint `index`, its format,
    version and the JSON's own sha256 checked (the index's small groups verified as any checkpoint's);
    from `loaded`, the index as ``checkpoints.read`` already gave it, where the caller has it."""
    from hpcdist.store.checkpoint import single as checkpoints

    if loaded is None:
        loaded = checkpoints.read(index, groups=("sharded",))  # format and version checked
    if not is_sharded(loaded.attrs):
        raise CheckpointError(f"{index}: not a sharded checkpoint (no {LAYOUT_ATTR} = {LAYOUT!r}); "
                              "read it with hpcdist.store.read")
    group = loaded.tree.get("sharded", {})
    text = str(group.get("metadata_json", ""))
    if hashlib.sha256(text.encode()).hexdigest() != group.get("metadata_sha256"):
        raise CheckpointError(f"{index}: its metadata_json does not match its metadata_sha256; corrupt")
    return loaded.attrs, text


@dataclass(frozen=True)
class Piece:
    """One saved chunk of a tensor: where in the tensor (`offsets`, `sizes`) and where on disk."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunk: Chunk


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a sharded checkpoint as its index records it, read without torch."""

    dtype: str  # torch's name without its prefix: "float32", "bfloat16"
    size: tuple[int, ...]
    pieces: list[Piece]


def tensors_of(text: str, prefix: str = "") -> dict[str, TensorEntry]:
    """The tensors of an index's metadata JSON whose name starts with `prefix` (removed from the
    keys), each with its chunks in order: what `metadata_from_json` gives DCP, as plain records."""
    data = json.loads(text)
    pieces: dict[str, list[Piece]] = {}
    for fqn, offset, _, c in data["chunks"]:
        if fqn.startswith(prefix) and fqn in data["tensors"] and offset is not None:
            sizes = next(s for o, s in data["tensors"][fqn]["chunks"] if o == offset)
            pieces.setdefault(fqn, []).append(Piece(tuple(offset), tuple(sizes), Chunk.from_record(c)))
    return {fqn.removeprefix(prefix): TensorEntry(t["dtype"].removeprefix("torch."), tuple(t["size"]),
                                                  sorted(pieces.get(fqn, []), key=lambda p: p.offsets))
            for fqn, t in data["tensors"].items() if fqn.startswith(prefix)}


def open_shard(folder: Path, name: str, source: Path | None = None) -> int:
    """The shard file `name` of the shard folder `folder`, opened for reading. With `source` (that
    folder as reached through the run's held checkpoint folder, ``owned.held``) it is opened there
    and must be this user's own, as must the shard folder (``owned``: a resume reads nothing that
    another user could have written)."""
    if source is None:
        return os.open(folder / name, os.O_RDONLY | os.O_CLOEXEC)
    why = owned.problem(source, folder=True)
    if why is not None:
        raise CheckpointError(f"shard folder {folder}: {why}")
    return owned.open_own(source / name, folder / name)


def read_chunk(folder: Path, chunk: Chunk, what: str, into: np.ndarray | None = None,
               source: Path | None = None) -> np.ndarray:
    """One chunk's bytes as stored (into `into`, a byte view of its destination, when given), not
    yet verified: one ``os.preadv`` at its offset (through HDF5 for an empty one). `what` names it
    in errors ("tensor model.wte.weight"); `source`: where to open it, checked (`open_shard`)."""
    path = folder / chunk.file
    try:
        fd = open_shard(folder, chunk.file, source)
        try:
            if chunk.offset >= 0:
                arr = into if into is not None else np.empty(chunk.shape, dtype=np.dtype(chunk.dtype))
                got = os.preadv(fd, [arr.reshape(-1).view(np.uint8).data], chunk.offset) if arr.nbytes else 0
                if got != arr.nbytes:
                    raise CheckpointError(f"{path}: {what} (written by rank {chunk.rank}) lies past the end "
                                          f"of the file; truncated (read by rank {_rank()})")
            else:
                import h5py

                with h5py.File(f"/proc/self/fd/{fd}", "r") as f:  # the file opened (and checked) above
                    arr = np.asarray(f[chunk.dataset][()])
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what} (written by rank {chunk.rank}): "
                              f"{exc.strerror or exc} (read by rank {_rank()})") from exc
    return arr


def _key(index: MetadataIndex) -> str:
    return index.fqn.replace("%", "%25").replace("/", "%2F")


def _host(t: torch.Tensor) -> torch.Tensor:
    """A chunk to write: a contiguous CPU tensor (no copy when it is one already), which the store
    writes in its one encoding (``hpcdist.store.checkpoint.tree``: a dtype NumPy lacks as its bits, with the
    dataset attribute ``torch_dtype``, as in an unsharded checkpoint)."""
    return t.detach().cpu().contiguous()


def _as_tensor(arr: np.ndarray, chunk: Chunk, size: torch.Size) -> torch.Tensor:
    """A chunk as read (the array HDF5 holds) as a tensor of its dtype and `size` (`tree.typed`)."""
    return as_tensor(typed(arr, chunk.torch_dtype.removeprefix("torch."))).reshape(size)


def _failure(exc: BaseException, what: str) -> CheckpointError:
    return exc if isinstance(exc, CheckpointError) else CheckpointError(f"{what}: {type(exc).__name__}: {exc}")


def remove_orphans(directory: Path, below: int) -> list[Path]:
    """Shard folders of steps older than `below` whose index is gone (pruned, or never committed).

    Each is renamed at once to a hidden name (``.purge-<name>-<hex>``) that no reader or listing
    looks at, and deleted by one background thread (`purge_wait` waits for it): freeing a large
    file's blocks takes about 0.25 ms per MB on this ext4 (200 ms for 800 MB), which was on every
    save's path; torchtitan's ``CheckpointManager`` purges old checkpoints in a thread too. At exit
    the interpreter joins that thread after its queued deletions (concurrent.futures' exit hook);
    what a process killed first left is deleted by the next call.
    """
    directory = Path(directory)
    gone, trash = [], []
    for folder in directory.glob(f"step_*{SUFFIX}"):
        step = step_of(folder.with_name(folder.name.removesuffix(SUFFIX) + ".h5"))
        if step is not None and step < below and not folder.with_name(checkpoint_name(step)).exists():
            hidden = folder.with_name(f"{PURGE_MARK}{folder.name}-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(folder, hidden)
            except OSError:
                continue  # gone already (another call), or not ours to move: left for the next save
            trash.append(hidden)
            gone.append(folder)
    trash += [p for p in directory.glob(f"{PURGE_MARK}*") if p not in trash]
    if trash:
        pool("purge", 1).submit(_remove_all, trash)
    return gone


def _remove_all(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def purge_wait() -> None:
    """Return once every folder `remove_orphans` handed to the background is deleted."""
    pool("purge", 1).submit(lambda: None).result()


# ---------------------------------------------------------------- the index as JSON


def metadata_to_json(md: Metadata) -> str:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, plain = {}, []
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[fqn] = {"dtype": str(meta.properties.dtype), "size": list(meta.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks]}
        else:
            plain.append(fqn)
    storage = [[i.fqn, None if i.offset is None else list(i.offset), i.index, dict(vars(c))]  # a flat Chunk:
               for i, c in md.storage_data.items()]  # its fields as they are (asdict's deep copy was 4 % of a save)
    try:
        return json.dumps({"version": md.version, "tensors": tensors, "bytes": plain, "chunks": storage,
                           "planner_data": md.planner_data}, separators=(",", ":"))
    except TypeError as exc:
        raise CheckpointError(
            f"the planner's data of this checkpoint is not JSON ({exc}); use DCP's default planner") from exc


def metadata_from_json(text: str) -> Metadata:
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    data = json.loads(text)
    sd: dict[str, Any] = {
        fqn: TensorStorageMetadata(TensorProperties(dtype=getattr(torch, t["dtype"].removeprefix("torch."))),
                                   torch.Size(t["size"]),
                                   [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]])
        for fqn, t in data["tensors"].items()
    }
    sd.update({fqn: BytesStorageMetadata() for fqn in data["bytes"]})
    storage = {MetadataIndex(fqn, offset, index): Chunk.from_record(c)
               for fqn, offset, index, c in data["chunks"]}
    planner = data["planner_data"]
    if isinstance(planner, dict):
        planner = {k: tuple(v) if isinstance(v, list) else v for k, v in planner.items()}
    return Metadata(sd, planner_data=planner, storage_data=storage, version=data["version"])


def _nbytes(chunk: Chunk) -> int:
    return math.prod(chunk.shape) * np.dtype(chunk.dtype).itemsize


def _rank() -> int:
    """This process's rank in the default group (0 without one); torch.distributed only where
    torch is already loaded (a login node reads chunks without it)."""
    import sys

    if "torch.distributed" not in sys.modules:
        return 0
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------- what DCP's flattening loses


def keys_record(state: Mapping[str, Any]) -> str:
    """JSON of what DCP's flattening of `state` loses ("" when nothing): the int keys of each dict
    that has some (an optimizer's ``state``), by the dict's path as DCP spells it (keys as strings,
    list positions as ints), and the paths of the empty dicts (an optimizer's ``state`` before its
    first step), which DCP does not save at all."""
    ints: list[list[Any]] = []
    empty: list[list[Any]] = []

    def walk(value: Any, path: list[Any]) -> None:
        if isinstance(value, Mapping):
            if not value:
                empty.append(path)
            keys = [k for k in value if isinstance(k, int) and not isinstance(k, bool)]
            if keys:
                ints.append([path, keys])
            for k, v in value.items():
                walk(v, [*path, str(k)])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, [*path, i])

    walk(state, [])
    return json.dumps({"ints": ints, "empty": empty}, separators=(",", ":")) if ints or empty else ""


def restore_keys(state: dict[str, Any], record: str) -> None:
    """Put back into `state` (as DCP's planner data rebuilt it) what `keys_record` recorded."""
    if not record:
        return
    data = json.loads(record)
    for path in data.get("empty", []):
        if not path:
            continue  # the state itself: the caller's dict
        parent, key = _parent(state, path, make=True)
        if parent is not None and _get(parent, key) is None:
            if isinstance(parent, list):
                parent.extend([None] * (int(key) + 1 - len(parent)))
            parent[key] = {}
    for path, keys in sorted(data.get("ints", []), key=lambda item: len(item[0])):
        wanted = {str(k): int(k) for k in keys}
        if not path:
            renamed: dict[Any, Any] = {wanted.get(k, k) if isinstance(k, str) else k: v for k, v in state.items()}
            state.clear()
            state.update(renamed)
            continue
        parent, key = _parent(state, path, make=False)
        inner = _get(parent, key) if parent is not None else None
        if isinstance(inner, dict):
            parent[key] = {wanted.get(k, k) if isinstance(k, str) else k: v for k, v in inner.items()}


def _get(container: Any, key: Any) -> Any:
    if isinstance(container, list):
        return container[key] if isinstance(key, int) and key < len(container) else None
    if key in container:
        return container[key]
    return container.get(int(key)) if isinstance(key, str) and key.lstrip("-").isdigit() else None


def _parent(state: dict[str, Any], path: list[Any], *, make: bool) -> tuple[Any, Any]:
    """The container holding `path`'s last step, and that step as the container spells it (a dict
    key already turned back into an int is found as such); (None, None) where the path is gone."""
    node: Any = state
    for i, step in enumerate(path[:-1]):
        nxt = _get(node, step)
        if nxt is None:
            if not make:
                return None, None
            nxt = [] if isinstance(path[i + 1], int) else {}
            if isinstance(node, list):
                node.extend([None] * (int(step) + 1 - len(node)))
            node[step] = nxt
        node = nxt
    last = path[-1]
    if isinstance(node, dict) and isinstance(last, str) and last not in node and last.lstrip("-").isdigit() \
            and int(last) in node:
        last = int(last)
    return node, last


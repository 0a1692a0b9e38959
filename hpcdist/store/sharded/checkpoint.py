"""Sharded checkpoints: ``torch.distributed.checkpoint``'s storage layer, writing hpcdist's HDF5.

`ShardedWriter` and `ShardedReader` implement DCP's ``StorageWriter`` / ``StorageReader``, so
DCP's planner decides what each rank writes (each replicated tensor once, by one rank) and
reads (only the chunks its own layout needs, at any mesh or world size). Layout of step 120:

- ``step_00000120.shards/r<rank:05d>-<attempt>.h5``: one HDF5 file per rank, written under a
  temporary name, fdatasynced, renamed (``hpcdist.files.atomic``). Its ``/tensors/<fqn>/<offsets>``
  datasets are the tensor chunks that rank saved (``<offsets>`` joined by ``_``), its
  ``/values/<fqn>`` the other values as UTF-8 JSON (``hpcdist.store.checkpoint.values``; format 1 kept DCP's
  pickles under ``/bytes``); each carries its digest (``hpcdist.store.checksum``).
  ``<attempt>`` is new at every save, so a save that dies never touches a committed file.
- ``step_00000120.h5``: the index, an ordinary ``hpcdist.checkpoint`` file (root attribute
  ``layout = "sharded"``) whose group ``/sharded`` holds ``metadata_json`` (every tensor's
  dtype, size and chunks, and for each chunk its file, dataset, byte offset and digest) with its
  own ``metadata_sha256``, and ``files``. The coordinator writes it in ``finish``, after every
  rank's file is durable, through ``hpcdist.store.checkpoint.single.save``: the ``latest`` pointer,
  retention and discovery are the same as for unsharded checkpoints, and a crash of any rank
  before that leaves the previous commit the latest.

A reader reads each chunk it needs with one ``os.preadv`` and checks its digest first (every
rank what it reads itself); a mismatch is one CheckpointError naming the file, the tensor, the
rank that wrote it and the rank reading. The metadata and the values are JSON, not pickles, so
``h5dump`` shows all of it and loading runs nothing from the file.

This module holds the calls (save, load, background save, import and export of DCP folders);
the storage layer is ``sharded_storage``, the names and the index's JSON ``sharded_layout``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.staging import AsyncStager

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint import single as checkpoints
from hpcdist.store.checkpoint import values
from hpcdist.store.checkpoint.directory import checkpoint_name, checkpoints_in, committed_in, step_of
from hpcdist.store.sharded import replicas
from hpcdist.store.sharded.layout import (
    KEYS_ATTR,
    Chunk,
    _failure,
    is_sharded,
    keys_record,
    purge_wait,
    shards_dir,
)
from hpcdist.store.sharded.storage import ShardedReader, ShardedWriter, deliver

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
         epoch: int = 0, identity: Callable[[], Mapping[str, Any]] | None = None) -> checkpoints.SaveStats | None:
    """Every rank of `process_group` saves its part of `state` (each replicated value once, see
    `prepare`); committed once. The coordinator's SaveStats (None on other ranks). `identity`: the
    commit's run, job and claim check (``CheckpointStore.commit_identity``)."""
    writer = ShardedWriter(directory, step, epoch=epoch, attrs=attrs, keep_last=keep_last, identity=identity)
    save_with(prepare(state, writer, process_group), writer, process_group)
    return writer.stats


def prepare(state: dict[str, Any], writer: ShardedWriter, process_group: Any = None, *,
            replicated: Callable[[str], bool] | None = None, full: bool = False) -> dict[str, Any]:
    """What this rank hands DCP to save `state` through `writer` (a collective on `process_group`):
    `state` less the replicated values (everything not a DTensor, under the top-level keys
    `replicated` accepts) that other ranks write, after comparing them across the ranks
    (``hpcdist.store.sharded.replicas``; every byte with `full`); the values this rank writes though the
    ranks' copies differ go to ``writer.differing``. The index records the dict keys and empty
    dicts that DCP's flattening loses (``sharded_layout.keys_record``)."""
    record = keys_record(state)
    if record:
        writer.attrs[KEYS_ATTR] = record
    split = replicas.split(state, process_group, replicated=replicated, full=full)
    writer.differing = split.differing
    return split.state


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def one_error() -> Iterator[None]:
    """DCP's exceptions (its ``CheckpointException`` gathers every rank's) as one ``CheckpointError``
    (``error_of``); an interrupt stays what it is."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise error_of(exc) from exc


def save_with(state: dict[str, Any], writer: ShardedWriter, process_group: Any = None) -> None:
    """`save` through a given writer: every rank returns once committed, or raises the same error.
    A state of replicated values (no DTensor) from `prepare` skips DCP's planning round
    (``hpcdist.store.sharded.direct``); DTensors go through ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    if not _no_dist() and not replicas.holds_dtensor(state):
        from hpcdist.store.sharded import direct

        direct.save(state, writer, process_group)
        return
    with one_error():
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=_no_dist())


class Stager(AsyncStager):
    """The host copy a background save blocks for, made into the previous save's buffers when the
    state has the same layout (no fresh pages to fault in, as `staging.snapshot`'s `reuse`). Use one
    per run and wait for a save before staging the next: the buffers are the save's source. Given
    the state `prepare` left this rank, each rank copies only the replicated values it writes, so
    a replicated state's copy is split across the ranks instead of made whole on each."""

    _synchronize_after_execute = False

    def __init__(self, process_group: Any = None) -> None:
        self._cache: Any = None
        self._layout: Any = None
        self.group = process_group

    def synchronize_staging(self) -> None:  # staging is done when `stage` returns
        return None

    def close(self) -> None:
        self._cache = self._layout = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        cuda = torch.cuda.is_available()
        if self._cache is None or layout != self._layout:  # pinned on a GPU node: the copy runs at DMA speed
            self._cache, self._layout = _create_cpu_state_dict(state_dict, pin_memory=cuda), layout
        staged = _copy_state_dict(state_dict, self._cache, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()  # the copies are done before the caller may change its tensors
        return staged


owners = replicas.owners  # which rank writes each replicated value (its owner is ``hpcdist.store.sharded.replicas``)


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

    with one_error():
        return dcp.async_save(state, storage_writer=writer, process_group=process_group, no_dist=_no_dist(),
                              async_stager=stager)


def wait(future: Any) -> None:
    """The outcome of `save_async`: returns once committed, or raises its CheckpointError."""
    with one_error():
        future.result()


def load(index: Path | str, state: dict[str, Any], *, process_group: Any = None, own: bool = False) -> dict[str, Any]:
    """Fill `state` (any layout) in place from the sharded checkpoint `index`; its root attributes.
    `own`: a resume, which reads only what no other user could have written (`ShardedReader`)."""
    import torch.distributed.checkpoint as dcp

    reader = ShardedReader(index, process_group, own=own)
    with one_error():
        dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=_no_dist())
    reader.read_metadata()
    return reader.attrs


def read_full(index: Path | str, keys: list[str] | None = None) -> dict[str, Any]:
    """The whole state of a sharded checkpoint in this process (every tensor full, every chunk
    verified, no process group); with `keys`, only those entries (top-level names such as
    ``model``, or flattened ones), the only bytes read. Dict keys come back as they were saved
    (an optimizer's int keys), empty dicts too (``hpcdist.store.sharded.node_read``)."""
    from hpcdist.store.sharded.node_read import read_state

    return read_state(index, keys=keys)[0]


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
            load(directory / checkpoint_name(step), state, process_group=process_group, own=True)
            return step
        except CheckpointError as exc:
            if report is not None:
                report(f"skipped step {step}: {exc}")
    return None


def import_dcp(source: Path | str, directory: Path | str, step: int, **kw: Any) -> checkpoints.SaveStats | None:
    """A ``dcp.save`` folder (``FileSystemWriter``) as step `step` of hpcdist checkpoint `directory`
    (in one process: the whole state passes through its memory)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with one_error():
        _load_state_dict(state, FileSystemReader(str(source)), planner=_DataOnly(str(source)), no_dist=True)
    return save(directory, step, state, **kw)


class _DataOnly(_EmptyStateDictLoadPlanner):
    """DCP's planner for a whole folder, its pickled values loaded as data only (``weights_only=True``,
    ``hpcdist.store.checkpoint.values``): a DCP folder someone else wrote runs nothing here."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: Any, value: Any) -> None:
        deliver(self, read_item, values.unpickle_data(value, f"{self.where}: entry {read_item.dest_index.fqn}"))


def export_dcp(index: Path | str, target: Path | str) -> None:
    """A sharded checkpoint written as a ``dcp.save`` folder (``FileSystemWriter``), for DCP's users."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(read_full(index), storage_writer=FileSystemWriter(str(target)), no_dist=True)


__all__ = ["Chunk", "ShardedReader", "ShardedWriter", "checkpoints_in", "export_dcp", "import_dcp", "is_sharded",
           "load", "load_latest", "purge_wait", "read_full", "save", "Stager", "save_async", "save_with", "shards_dir",
           "wait"]


"""A sharded save of values every rank holds alike, without DCP's planning round (node side).

DCP's ``save`` gathers every rank's plan to the coordinator (pickled), which dedups the replicated
values and scatters the final plans back before any rank writes: a round trip of the whole plan
that a save of replicated values has already made unnecessary, because ``sharded.replicas`` has
given each value one owner and each rank holds only its own (``sharded.checkpoint.prepare``). So,
for a state holding no DTensor, each rank plans its own part with DCP's own planner
(``DefaultSavePlanner``: the same write items, flattening and metadata as ``dcp.save``), and the
ranks exchange only what the commit needs, as text (``collective.gather_text``: no rank unpickles
another's bytes):

1. the coordinator starts the save (``ShardedWriter.begin``: the attempt's name, the run identity)
   and every rank learns the attempt, or the coordinator's error, before anything is written;
2. every rank writes its HDF5 file (``ShardedWriter.write_data``) and sends its part of the
   index (``sharded.layout``'s metadata JSON, with its chunks) and its file's size, or its error;
3. the coordinator merges the parts and commits (``ShardedWriter.commit``); every rank returns
   once committed, or raises the same CheckpointError (the lowest failing rank's).

The files and the index are those a ``dcp.save`` through ``ShardedWriter`` writes, so every reader
is unchanged. Measured in ``benchmarks/ckpt_api.py`` (docs/performance.md).
"""

from __future__ import annotations

import json
from typing import Any

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint.collective import gather_text
from hpcdist.store.sharded.layout import metadata_to_json
from hpcdist.store.sharded.storage import ShardedWriter

WHAT = "a sharded checkpoint's save"


def save(state: dict[str, Any], writer: ShardedWriter, process_group: Any = None) -> None:
    """Every rank of `process_group` (torch's default group for None) writes its part of `state`,
    which holds no DTensor and no value another rank also writes; rank 0 commits. A collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    rank = dist.get_rank(process_group)
    coordinator = rank == 0
    planner = DefaultSavePlanner()
    start = ""
    try:
        writer.set_up_storage_writer(coordinator)
        planner.set_up_planner(state, storage_meta=None, is_coordinator=coordinator)
        if coordinator:
            start = json.dumps({"attempt": writer.begin()})
    except Exception as exc:
        start = json.dumps({"error": _message(exc, rank)})
    begun = [json.loads(t) if t else {} for t in gather_text(process_group, start, WHAT)]
    _raise_first(begun)  # a rank's set-up, or the coordinator's start, failed
    attempt = begun[0]["attempt"]

    try:
        part = _write(planner, writer, attempt, rank)
    except Exception as exc:
        part = json.dumps({"error": _message(exc, rank)})
    parts = [json.loads(t) for t in gather_text(process_group, part, WHAT)]
    outcome = ""
    if coordinator:
        try:
            _raise_first(parts)
            writer.commit(*_merge(parts))
        except Exception as exc:
            outcome = _message(exc, rank)
    outcome = gather_text(process_group, outcome, WHAT)[0]
    if outcome:
        raise CheckpointError(outcome)


def _write(planner: Any, writer: ShardedWriter, attempt: str, rank: int) -> str:
    """This rank's file written; its part of the index (metadata JSON with its chunks) and its size."""
    from dataclasses import replace

    local = planner.create_local_plan()
    plans, metadata = planner.create_global_plan([local])  # this rank's items alone: its metadata
    plan = planner.finish_plan(replace(plans[0], storage_data=(attempt, rank)))
    results = writer.write_data(plan, planner)
    results.wait()
    metadata.storage_data = {r.index: r.storage_data for r in results.value()}
    size = sum(r.size_in_bytes for r in results.value())  # the file's (``ShardedWriter.write_data``)
    return json.dumps({"metadata": metadata_to_json(metadata), "bytes": size})


def _merge(parts: list[dict[str, Any]]) -> tuple[str, list[str], int]:
    """The ranks' parts of the index as one metadata JSON, the files its chunks lie in, and
    their bytes together."""
    merged: dict[str, Any] = {"tensors": {}, "bytes": [], "chunks": [], "planner_data": {}}
    for part in parts:
        md = json.loads(part["metadata"])
        twice = (set(md["tensors"]) & set(merged["tensors"])) | (set(md["bytes"]) & set(merged["bytes"]))
        if twice:
            raise CheckpointError(f"two ranks wrote {sorted(twice)[:3]} in one save; each value has one writer")
        merged["version"] = md["version"]
        merged["tensors"].update(md["tensors"])
        merged["bytes"] += md["bytes"]
        merged["chunks"] += md["chunks"]
        merged["planner_data"].update(md["planner_data"] or {})
    files = sorted({chunk[3]["file"] for chunk in merged["chunks"]})
    return json.dumps(merged, separators=(",", ":")), files, sum(part["bytes"] for part in parts)


def _raise_first(parts: list[dict[str, Any]]) -> None:
    for part in parts:
        if "error" in part:
            raise CheckpointError(part["error"])


def _message(exc: BaseException, rank: int) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"rank {rank}: {type(exc).__name__}: {exc}"

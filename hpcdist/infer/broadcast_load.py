"""``infer_gpt``'s ``load: broadcast``: rank 0 reads the checkpoint a bucket at a time and broadcasts
it; every rank copies its tensor-parallel shard of the bucket into its model before the next comes.

So no rank ever holds the whole model. Received whole and sliced afterwards, a model that fits a GPU
only sharded ran out of its memory while loading; now a rank's peak is its shard (the model, in the
dtype it runs in) plus one bucket in the checkpoint's dtype (``bucket_mb``, or the largest tensor
where that is bigger) and the bucket's shard on its way into the model. A bucket is consecutive
tensors of the checkpoint, grouped by `plan_buckets`, sent by `broadcast_state` into one receive
buffer of the largest bucket's size that every rank allocates (and faults in, on CPUs) once. Each
rank ends with the very bytes the whole-model broadcast gave it: `shard_state` slices the same
tensors, a bucket at a time.

Checks: rank 0 reads each tensor (each FSDP chunk) of a bucket whole and checks its digest before
sending it (`read_shard` with ``tp=1``), then hashes every tensor-parallel rank's shard of it; with
``verify_received`` each other rank hashes the shard it keeps (on host, one tensor at a time)
against rank 0's hash of that shard. A rank checks exactly the bytes it uses; no rank copies the
whole model to host. Rank 0 sends its read error, or the hashes, before each bucket, so a damaged
file fails every rank at that bucket instead of leaving them waiting for bytes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpcdist.errors import CheckpointError, HpcdistError, JobError
from hpcdist.infer.broadcast import BroadcastStats, Meta, broadcast_state, flat_buffer, layout, plan_buckets
from hpcdist.infer.shard_load import read_shard, shard_state
from hpcdist.progress import report_progress
from hpcdist.runtime.plain import all_gather_plain, broadcast_plain
from hpcdist.store import checksum
from hpcdist.store.checkpoint.tree import tensor_array
from hpcdist.store.hostmem import release_free_heap

if TYPE_CHECKING:
    from hpcdist.infer.tp import TPGPT
    from hpcdist.model.checkpoint import CheckpointHeader


def shard_digests(header: CheckpointHeader, state: dict[str, torch.Tensor], tp: int) -> dict[str, list[str]]:
    """Each tensor's digest of each tensor-parallel rank's shard of it, in rank order: the recorded
    digest where a rank holds the tensor whole (a sharded checkpoint records none per tensor)."""
    out: dict[str, list[str]] = {}
    for key, value in state.items():
        whole = None if header.sharded else header.digests.get(key)
        digests = []
        for r in range(tp):  # one rank's shard at a time: never a second whole copy
            part = shard_state({key: value}, header.config, r, tp)[key]
            if part is value:  # replicated: the rank holds it whole
                whole = whole or checksum.digest(tensor_array(value))
                digests.append(whole)
            else:
                digests.append(checksum.digest(tensor_array(part)))
        out[key] = digests
    return out


def _read(header: CheckpointHeader, keys: list[str], tp: int, verify: bool) -> tuple[dict[str, Any] | None, list[Any]]:
    """On rank 0: the tensors `keys`, each checked against its digest, and the box the others get
    first: [rank 0's error or None, the shard digests or None]."""
    try:
        read = read_shard(header, 0, 1, 0, 1, keys=keys)
    except (HpcdistError, OSError, KeyError) as exc:
        return None, [f"checkpoint {header.path}: {exc}", None]
    if read.bad:
        return None, [f"checkpoint {header.path}: tensors {read.bad[:3]} do not match their checksums; "
                      "the file is corrupt", None]
    return read.state, [None, shard_digests(header, read.state, tp) if verify else None]


def load_streamed(header: CheckpointHeader, model: TPGPT, device: torch.device, bucket_bytes: int,
                  verify: bool) -> dict[str, Any]:
    """Fill `model` (this rank's shard) with `header`'s checkpoint, broadcast from rank 0 a bucket at
    a time; returns the load's figures (rank 0's read time, the transfer's bytes, time and bandwidth)."""
    tp = model.tp
    is_src = dist.get_rank() == 0
    meta: Meta = [(name, tuple(shape), header.dtypes[name]) for name, shape in header.shapes.items()]
    parts = [[meta[i] for i in bucket] for bucket in plan_buckets(meta, bucket_bytes)]
    buffer = flat_buffer(max(parts, key=lambda part: layout(part)[1]), device)
    if device.type == "cpu" and not is_src:  # (rank 0 sends its big tensors as it read them, packs the rest)
        buffer.zero_()  # its pages faulted in once, not during every bucket's transfer
    read_s = seconds = 0.0
    nbytes = collectives = wrong = 0
    for n, part in enumerate(parts):
        keys = [name for name, _, _ in part]
        state: dict[str, Any] | None = None
        box: list[Any] = [None, None]  # rank 0's error, the shard digests
        if is_src:
            t0 = time.perf_counter()
            state, box = _read(header, keys, tp.size, verify)
            read_s += time.perf_counter() - t0
        box = broadcast_plain(box, src=0, device=device if device.type == "cuda" else None, what="the shard digests")
        if box[0]:
            raise CheckpointError(f"rank 0 could not read the checkpoint: {box[0]}")
        got, stats = broadcast_state(state, device, bucket_bytes=bucket_bytes, meta=part, buffer=buffer)
        for key in keys:  # a tensor at a time: one tensor's shard beside the bucket, copied into the model
            mine = shard_state({key: got[key]}, header.config, tp.rank, tp.size)
            if verify and not is_src:  # rank 0 checked what it read and sliced it itself
                wrong += not checksum.matches(tensor_array(mine[key]), box[1][key][tp.rank])
            model.load_shard(mine, last=False)
        del state, got
        release_free_heap()  # this round's temporaries, which glibc would keep resident
        seconds, nbytes, collectives = seconds + stats.seconds, nbytes + stats.bytes, collectives + stats.buckets
        report_progress("load weights", n + 1, len(parts), unit="bucket")
    model.load_shard({}, last=True)  # every tensor in: the head and the layers' packed weights made
    if verify:
        counts = all_gather_plain(wrong, what="its count of wrong tensors")
        bad = {r: c for r, c in enumerate(counts) if c}
        if bad:
            raise JobError(f"broadcast weights differ from the checkpoint on ranks {sorted(bad)} "
                           f"({', '.join(f'rank {r}: {c} tensors' for r, c in bad.items())}): changed on their way; "
                           "rerun, and if it repeats check those ranks' nodes")
        wrong = sum(counts)
    stats = BroadcastStats(nbytes, seconds, collectives, len(meta), dist.get_world_size())
    return {"method": "broadcast", "read_s": read_s, "rounds": len(parts), "wrong": wrong, **stats.as_dict()}

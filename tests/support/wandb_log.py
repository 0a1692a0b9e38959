"""Reading back what W&B wrote offline: the records of a ``run-<id>.wandb`` file, decoded with W&B's
own protobuf (``wandb.proto.wandb_internal_pb2.Record``). The file is W&B's transaction log in
LevelDB's log layout (32 KiB blocks, records split FIRST/MIDDLE/LAST, a ``:W&B`` header), which
wandb 0.31 reads only in its Go core; this is the few lines of the layout, nothing of the content."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = struct.Struct("<4sHB")  # b":W&B", 0xBEE1, version 0
RECORD = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    ident, magic, _ = HEADER.unpack_from(data, 0)
    assert ident == b":W&B" and magic == 0xBEE1, f"{path}: not a W&B transaction log"
    out: list[bytes] = []
    pos, parts = HEADER.size, b""
    while pos + RECORD.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:
            pos += left
            continue
        _, length, kind = RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        body = data[pos + RECORD.size: pos + RECORD.size + length]
        pos += RECORD.size + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            parts = body
        elif kind == MIDDLE:
            parts += body
        elif kind == LAST:
            out.append(parts + body)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Each history row of a run file: its step and values, in the order logged."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            rows.append(row)
    return rows


def run_ids(path: Path) -> set[str]:
    from wandb.proto import wandb_internal_pb2 as pb

    ids = set()
    for raw in records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            ids.add(record.run.run_id)
    return ids

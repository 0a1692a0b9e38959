"""``hpcdist ckpt export-dcp CHECKPOINT DIR`` and ``hpcdist ckpt import-dcp DIR -o CKPTDIR``:
hpcdist checkpoints to and from ``torch.distributed.checkpoint``'s own folder format
(``FileSystemWriter``: ``.metadata`` and ``__<rank>_<n>.distcp`` files), which torchtitan,
Lightning and plain ``dcp.save`` / ``dcp.load`` read and write (``hpcdist.store.sharded``).

Both run in one process, the whole state passing through its memory: for a state too big for
that, read ours in place with ``dcp.load(state, storage_reader=ShardedReader(INDEX))``.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def add_parser(subs: Any) -> None:
    p = subs.add_parser("ckpt", help="move checkpoints to and from torch.distributed.checkpoint (DCP) folders")
    csubs = p.add_subparsers(dest="ckpt_command", required=True)
    exp = csubs.add_parser("export-dcp", help="an hpcdist checkpoint (sharded or not) as a dcp.save folder")
    exp.add_argument("checkpoint", type=Path, help="a checkpoint file (step_*.h5), or a checkpoint directory "
                     "(its latest)")
    exp.add_argument("output", type=Path, help="new folder to write")
    imp = csubs.add_parser("import-dcp", help="a dcp.save folder as a sharded hpcdist checkpoint")
    imp.add_argument("directory", type=Path, help="folder written by dcp.save (FileSystemWriter): has .metadata")
    imp.add_argument("-o", "--output", type=Path, required=True, help="hpcdist checkpoint directory to commit into")
    imp.add_argument("--step", type=int, default=0, help="the step to commit it as (default 0)")


def cmd_ckpt(args: argparse.Namespace) -> int:
    if args.ckpt_command == "export-dcp":
        path, entries = export_dcp(args.checkpoint, args.output)
        print(f"wrote {args.output}: {entries} entries of {path}; read it with torch.distributed.checkpoint.load "
              f"(storage_reader=FileSystemReader({str(args.output)!r}))")
        return 0
    stats = import_dcp(args.directory, args.output, args.step)
    from hpcdist.store import checksum

    print(f"committed {stats.path}: {stats.bytes / 1e6:.1f} MB from {args.directory} (sharded, a {checksum.chosen()} "
          "digest per chunk)")
    return 0


def export_dcp(checkpoint: Path, output: Path) -> tuple[Path, int]:
    """`checkpoint` (a file or a directory's latest) written as DCP folder `output`; (the file, its
    top-level entries). Groups go as nested dicts, numeric arrays as tensors: an unsharded
    checkpoint's all, a sharded one's index values (a trainer's sampler, scheduler) and shards."""
    from hpcdist.errors import ConfigError
    from hpcdist.store import sharded
    from hpcdist.store.checkpoints import read, read_header
    from hpcdist.store.discovery import resolve

    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"{output} already exists and is not an empty folder; give a new folder")
    path = resolve(checkpoint)
    tree = read(path, verify=True).tree  # a sharded checkpoint's index: its values beside the shards' list
    with _single_process():
        if sharded.is_sharded(read_header(path, "sharded").attrs):
            state = {**_tensors({k: v for k, v in tree.items() if k != "sharded"}), **sharded.read_full(path)}
        else:
            state = _tensors(tree)
        _save_dcp(state, output)
    return path, len(state)


def _tensors(tree: dict[str, Any]) -> dict[str, Any]:
    """A store tree with its numeric arrays as tensors (strings and other values as they are)."""
    import numpy as np
    import torch

    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = _tensors(value)
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            out[key] = torch.from_numpy(np.ascontiguousarray(value))
        else:
            out[key] = value
    return out


def _save_dcp(state: dict[str, Any], output: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from hpcdist.store.sharded import one_error

    output.mkdir(parents=True, exist_ok=True)
    with one_error():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(output)), no_dist=True)


def import_dcp(directory: Path, output: Path, step: int) -> Any:
    """DCP folder `directory` committed as step `step` of checkpoint directory `output`; its SaveStats."""
    from hpcdist.errors import CheckpointError
    from hpcdist.store import sharded

    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"{directory} is not a dcp.save folder (it has no .metadata); give the folder "
                              f"torch.distributed.checkpoint.save wrote")
    if step < 0:
        raise CheckpointError(f"--step {step} is negative; give a step of 0 or more")
    with sharded.one_error(), _single_process():
        return sharded.import_dcp(directory, output, step)


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP without a process group, quietly: its warning that it assumes one process is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

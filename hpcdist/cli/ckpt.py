"""``hpcdist ckpt export-dcp CHECKPOINT DIR`` and ``hpcdist ckpt import-dcp DIR -o CKPTDIR``:
hpcdist checkpoints to and from ``torch.distributed.checkpoint``'s folders (``hpcdist.store.sharded.dcp``)."""

from __future__ import annotations

import argparse
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
        from hpcdist.store.sharded.dcp import export_dcp

        path, entries = export_dcp(args.checkpoint, args.output)
        print(f"wrote {args.output}: {entries} entries of {path}; read it with torch.distributed.checkpoint.load "
              f"(storage_reader=FileSystemReader({str(args.output)!r}))")
        return 0
    from hpcdist.store import checksum
    from hpcdist.store.sharded.dcp import import_dcp

    stats = import_dcp(args.directory, args.output, args.step, report=print)
    print(f"committed {stats.path}: {stats.bytes / 1e6:.1f} MB from {args.directory} (sharded, a {checksum.chosen()} "
          "digest per chunk)")
    return 0

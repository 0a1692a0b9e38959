"""``hpcdist data prepare TEXT... -o tokens.h5``: tokenise local text for training."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subs: Any) -> None:
    p = subs.add_parser("data", help="prepare token data for training")
    dsubs = p.add_subparsers(dest="data_command", required=True)
    prep = dsubs.add_parser("prepare", help="tokenise text files into train/val splits in HDF5")
    prep.add_argument("texts", nargs="+", type=Path, help="local text files")
    prep.add_argument("-o", "--output", type=Path, required=True, help="token file to write, e.g. tokens.h5")
    prep.add_argument("--val-fraction", type=float, default=0.1, help="share of each file kept for validation")
    prep.add_argument(
        "--tokenizer", type=Path, default=None,
        help="a tokenizer.json from the `tokenizers` library, a save_pretrained folder, or a checkpoint "
        "carrying one (`hpcdist model import`) (default: bytes, vocabulary 257)",
    )


def cmd_data(args: argparse.Namespace) -> int:
    from hpcdist.data.tokens import prepare

    info = prepare(args.texts, args.output, val_fraction=args.val_fraction, tokenizer=args.tokenizer)
    print(
        f"wrote {info.path}: {info.lengths['train']:,} train and {info.lengths['val']:,} validation tokens, "
        f"tokenizer {info.tokenizer} (vocabulary {info.vocab_size}) from {len(args.texts)} file(s)"
    )
    return 0

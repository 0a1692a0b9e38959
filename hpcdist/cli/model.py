"""``hpcdist model import DIR -o CKPT.h5`` and ``hpcdist model export CKPT -o DIR``: Hugging Face
GPT-2, Llama, Mistral and Qwen2 folders in and out, with their tokenizer and chat template
(``hpcdist.model.hf``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subs: Any) -> None:
    p = subs.add_parser("model", help="bring a Hugging Face model in (GPT-2, Llama, Mistral, Qwen2), "
                        "or take a checkpoint out")
    msubs = p.add_subparsers(dest="model_command", required=True)
    imp = msubs.add_parser("import", help="a save_pretrained folder (GPT-2, DialoGPT, Llama, Mistral, Qwen2) "
                           "to an hpcdist checkpoint")
    imp.add_argument("directory", type=Path, help="folder with config.json, model.safetensors or "
                     "pytorch_model.bin (sharded or not), and tokenizer.json or vocab.json + merges.txt")
    imp.add_argument("-o", "--output", type=Path, required=True,
                     help="checkpoint to write: a file CKPT.h5, or a checkpoint directory")
    exp = msubs.add_parser("export", help="an hpcdist checkpoint to a folder transformers loads")
    exp.add_argument("checkpoint", type=Path, help="a checkpoint file, or a checkpoint directory (its latest)")
    exp.add_argument("-o", "--output", type=Path, required=True, help="new folder to write")


def cmd_model(args: argparse.Namespace) -> int:
    from hpcdist.model.hf import export_pretrained, import_pretrained

    if args.model_command == "import":
        done = import_pretrained(args.directory, args.output)
        c = done.config
        name = {"gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[c.family]
        heads = f"{c.n_head} heads" + (f" ({c.n_kv} KV)" if c.n_kv != c.n_head else "")
        print(
            f"wrote {done.path}: {name} of {done.parameters:,} parameters ({c.n_layer} layers, d_model "
            f"{c.d_model}, {heads}, context {c.context}, vocabulary {c.vocab_size}, {done.dtype}), "
            f"tokenizer {done.tokenizer}{', chat template' if done.chat_template else ''}"
        )
        return 0
    out, tok = export_pretrained(args.checkpoint, args.output)
    note = "" if tok.identity != "bytes" else " (the byte tokenizer has no transformers form: encode prompts as UTF-8)"
    print(f"wrote {out}: load it with transformers' from_pretrained; tokenizer {tok.name}{note}")
    return 0

"""Prompts from a file: plain text (one prompt per non-blank line) or JSON lines (``.jsonl``:
each line a JSON string or an object with a ``prompt`` string, so a prompt may hold newlines).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpcdist.errors import ConfigError


def load_prompts(path: str | Path) -> list[str]:
    """The prompts in `path`, in order; an unreadable, empty or malformed file is a ConfigError."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"prompt file {path} cannot be read: {exc}") from exc
    prompts: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"prompt file {path} line {n}: not JSON ({exc.msg})") from exc
            text = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(text, str) or not text:
                raise ConfigError(
                    f"prompt file {path} line {n}: expected a non-empty string or an object with a 'prompt' string"
                )
            prompts.append(text)
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"prompt file {path} has no prompts; put one prompt per line")
    return prompts

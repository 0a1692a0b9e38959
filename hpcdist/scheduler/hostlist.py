"""Slurm's compressed host lists (``n[1-3,7],gpu-[01-02]``), task counts (``2(x3),1``) and task
ids (``0-1,3``, as srun names the tasks that ended badly: ``task_end``).

Pure functions, checked against the examples in Slurm's documentation, so the bootstrap does
not need ``scontrol`` on the node.
"""

from __future__ import annotations

import re

_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
# srun's line for tasks that ended badly: "srun: error: n3: task 1: Killed", "... tasks 0-1: Exited with exit code 1"
_TASK_END = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+?)\s*$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(body: str, text: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in host list {text!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        start, stop = int(lo), int(hi)
        if stop < start:
            raise ValueError(f"range {item!r} runs backwards in host list {text!r}")
        out.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return out


def _expand_one(pattern: str, text: str) -> list[str]:
    """One host pattern, possibly with several bracket groups (``rack[1-2]-n[01-02]``)."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise ValueError(f"unbalanced ']' in host list {text!r}")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    head, body, tail = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    return [head + mid + rest for mid in _expand_range(body, text) for rest in _expand_one(tail, text)]


def expand_hostlist(text: str) -> list[str]:
    """Every host name in a Slurm host list, in order: ``n[1-2]`` -> ``['n1', 'n2']``."""
    text = text.strip()
    if not text:
        return []
    return [host for part in _split_top(text) for host in _expand_one(part, text)]


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's SLURM_TASKS_PER_NODE (``2(x3),1``) as one count per node: ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _COUNT.match(item.strip())
        if match is None:
            raise ValueError(f"bad tasks-per-node entry {item!r} in {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_task_ids(text: str) -> list[int]:
    """srun's task ids (``0-1,3``) as numbers: ``[0, 1, 3]``."""
    ids: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1)
    return ids


def task_end(line: str) -> tuple[str, list[int], str] | None:
    """srun's line for tasks that ended badly as (node, task ids, srun's words: ``Killed``,
    ``Exited with exit code 1``); None for any other line."""
    match = _TASK_END.match(line.strip())
    if match is None:
        return None
    return match.group(1), expand_task_ids(match.group(2)), match.group(3)

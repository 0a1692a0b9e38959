"""Sweeps: ``--sweep params.optim.lr=1e-3,3e-3 --sweep params.seed=1,2`` as one task per combination.

The cartesian product of the values, in the order given (the last key varies fastest). Each task
is a list of ``--set``-style overrides, so its values parse as ``--set`` values do (YAML
scalars, ``hpcdist.config.apply_overrides``), and a name suffix made from the values
(``-lr0.001-seed1``) that gives the task its own job name, hence its own result folder and
checkpoint directory (one writer per directory). Only ``params.`` keys may vary: the tasks of a
Slurm job array share one script, so anything rendered into it (resources, env) is the same.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from hpcdist.errors import ConfigError

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")  # what a job name allows (config.spec.NAME_PATTERN)


@dataclass(frozen=True)
class SweepTask:
    """One combination: its overrides (``KEY=VALUE``) and the suffix of its job name."""

    index: int
    overrides: tuple[str, ...]
    suffix: str


def split_values(text: str) -> list[str]:
    """`1e-3,3e-3` -> ['1e-3', '3e-3']; commas inside [...] or {...} stay (`[a,b],[c]` is two lists)."""
    values, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            values.append(text[start:i])
            start = i + 1
    values.append(text[start:])
    return values


def parse(sweeps: tuple[str, ...] | list[str]) -> list[tuple[str, list[str]]]:
    """Each `--sweep KEY=V1,V2,...` as (KEY, [V1, V2, ...]), or a ConfigError naming the bad one."""
    out: list[tuple[str, list[str]]] = []
    for item in sweeps:
        key, sep, raw = item.partition("=")
        values = split_values(raw)
        if not sep or not key or not raw or any(v == "" for v in values):
            raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2,..., e.g. params.optim.lr=1e-3,3e-3")
        if not key.startswith("params."):
            raise ConfigError(
                f"--sweep {item!r}: only params.* keys can vary across a sweep (its tasks share one job "
                f"script, so resources and env are the same for all); use --set for {key}"
            )
        if key in (k for k, _ in out):
            raise ConfigError(f"--sweep {item!r}: {key} is swept twice; give all its values in one --sweep")
        out.append((key, values))
    return out


def tasks(sweeps: tuple[str, ...] | list[str]) -> list[SweepTask]:
    """One task per combination of the swept values (none without sweeps)."""
    axes = parse(sweeps)
    if not axes:
        return []
    out: list[SweepTask] = []
    seen: set[str] = set()
    for i, combo in enumerate(itertools.product(*(values for _, values in axes))):
        pairs = [(key, value) for (key, _), value in zip(axes, combo, strict=True)]
        suffix = "".join(f"-{key.rsplit('.', 1)[-1]}{_UNSAFE.sub('_', value)}" for key, value in pairs)
        if suffix in seen:  # values that differ only in characters a name cannot hold
            suffix = f"{suffix}-{i}"
        seen.add(suffix)
        out.append(SweepTask(i, tuple(f"{k}={v}" for k, v in pairs), suffix))
    return out


def task_name(name: str, task: SweepTask) -> str:
    """The job name of a task: the spec's name and the task's suffix, within a name's 128 characters."""
    full = f"{name}{task.suffix}"
    return full if len(full) <= 128 else f"{name[:100]}-task{task.index}"

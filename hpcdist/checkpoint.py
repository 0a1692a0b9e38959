"""Training checkpoints on shared storage: HDF5 files that are never half-written where a reader looks.

Format ``hpcdist.checkpoint`` version 1 (readable by ``h5dump`` and by plain ``h5py``):

- Files ``<checkpoint dir>/step_<step:08d>.h5``. Each is written under a hidden temporary name in
  the same directory, flushed and fsynced, renamed onto its final name (``hpcdist.storage``), and
  only then *committed* by atomically rewriting the pointer file ``<dir>/latest``, whose whole
  content is the committed file's name (``step_00000120.h5``). A reader trusts only committed
  files: the one ``latest`` names, or older ones. Files newer than the pointer (a writer killed
  between rename and commit) are ignored.
- Root attributes: ``format = "hpcdist.checkpoint"``, ``format_version = 1``, ``step``,
  ``epoch``, ``model_config_json`` (``GPTConfig.model_dump_json()``), ``created`` (UTC ISO 8601),
  ``hpcdist_version``.
- ``/model``: one dataset per ``model.state_dict()`` key, with the exact key names, float32,
  C-order. A tied tensor is stored once: ``lm_head.weight`` (tied to ``transformer.wte.weight``)
  is not stored; the group attribute ``tied_json`` maps each omitted key to the stored one.
- Every dataset, in every group, carries the attribute ``sha256``: the hex SHA-256 of
  ``np.ascontiguousarray(arr).tobytes()``. A load verifies each dataset it reads.
- Groups written by the trainer (``hpcdist.train``):
  ``/optimizer`` (attribute ``param_groups_json``: the optimizer's param groups with parameter
  *names* in place of indices; ``/optimizer/state/<param name>/<key>``: AdamW's ``step``,
  ``exp_avg``, ``exp_avg_sq``), ``/scheduler`` and ``/scaler`` (attribute ``state_json``),
  ``/sampler`` (attributes ``seed``, ``epoch``, ``position`` = samples of the epoch already
  consumed, ``world_size``), ``/rng/rank_<r>`` (``torch_cpu``, ``torch_cuda`` when used,
  ``numpy_keys`` + attributes, ``python_state`` + attributes: every rank's generators),
  ``/train`` (attributes ``tokens_seen``, ``requeues``, ``timeouts``, ``world_size``, ``job_id``,
  ``params_json``) and ``/metrics/<table>`` (``steps``, ``val``, ``checkpoints``: the run's
  metrics so far, one dataset per column, column order in the attribute ``columns_json``).

Scalars and strings in the tree handed to ``save`` become attributes of their group; arrays and
tensors become datasets.

API: ``save`` (write, fsync, rename, commit, then prune to ``keep_last``), ``read`` (verified),
``load_model_state(path, verify=True) -> (GPTConfig, state dict)`` for ``GPT.load_state_dict``,
``find_latest(dir) -> Path | None`` (the newest committed checkpoint that verifies, reporting each
one it skips - truncated, flipped byte, dangling or empty pointer - and why), ``scan`` (the same,
with the reasons as data), and ``check_shapes`` (one error listing every mismatched tensor).
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdist import __version__
from hpcdist.errors import CheckpointError
from hpcdist.storage import atomic_path, is_temporary

if TYPE_CHECKING:
    import h5py
    import torch

    from hpcdist.model.gpt import GPTConfig

FORMAT = "hpcdist.checkpoint"
FORMAT_VERSION = 1
POINTER = "latest"
HASH_THREADS = 8
_NAME = re.compile(r"^step_(\d{8})\.h5$")
_ROOT_ATTRS = ("format", "format_version", "step", "epoch", "model_config_json", "created")

log = logging.getLogger("hpcdist")

Tree = dict[str, Any]  # nested: dict -> group, array/tensor -> dataset, scalar/str -> attribute


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.h5"


def step_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def sha256_of(arr: np.ndarray) -> str:
    """Hex SHA-256 of the array's C-order bytes (hashed in place: no copy for contiguous arrays)."""
    data = np.ascontiguousarray(arr)
    return hashlib.sha256(data.reshape(-1).view(np.uint8).data if data.size else b"").hexdigest()


def _hash_all(arrays: list[np.ndarray]) -> list[str]:
    """Hashes of many arrays, in threads: hashlib releases the GIL, so big checkpoints hash on all cores."""
    if sum(a.nbytes for a in arrays) <= 8 << 20:
        return [sha256_of(a) for a in arrays]
    with ThreadPoolExecutor(max_workers=_hash_threads()) as pool:
        return list(pool.map(sha256_of, arrays))


def _hash_threads() -> int:
    return max(1, min(HASH_THREADS, os.cpu_count() or 1))


def _as_array(value: Any) -> np.ndarray | None:
    """A dataset's array for a tree leaf, or None if the leaf is an attribute."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch.Tensor
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            t = t.float()
        return np.ascontiguousarray(t.numpy())
    return None


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class SaveStats:
    path: Path
    bytes: int
    seconds: float
    removed: tuple[Path, ...] = ()

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else float("nan")


def model_tree(state_dict: Mapping[str, Any]) -> Tree:
    """`/model` for a state dict: float32 arrays, tied tensors stored once (``tied_json``)."""
    out: Tree = {}
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    for key, value in state_dict.items():
        ident = (value.data_ptr(), tuple(value.shape)) if hasattr(value, "data_ptr") else None
        if ident is not None and ident in seen:
            tied[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        t = value.detach().cpu().float() if hasattr(value, "detach") else value
        arr = t.numpy() if hasattr(t, "numpy") else np.asarray(t, dtype=np.float32)
        out[key] = np.ascontiguousarray(arr, dtype=np.float32)
    out["tied_json"] = json.dumps(tied)
    return out


def _flatten(
    tree: Mapping[str, Any], prefix: str = ""
) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, str, Any]]]:
    """(dataset path, array) and (group path, attribute name, value) for a nested tree."""
    arrays: list[tuple[str, np.ndarray]] = []
    attrs: list[tuple[str, str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            sub_arrays, sub_attrs = _flatten(value, f"{prefix}{key}/")
            arrays += sub_arrays
            attrs += sub_attrs
            attrs.append((f"{prefix}{key}", "", None))  # the group exists even when empty
            continue
        arr = _as_array(value)
        if arr is None:
            attrs.append((prefix.rstrip("/") or "/", key, str(value) if isinstance(value, str) else value))
        else:
            arrays.append((f"{prefix}{key}", arr))
    return arrays, attrs


def _write_tree(f: h5py.File, tree: Mapping[str, Any]) -> int:
    """Datasets (each with its sha256) and attributes of `tree` in `f`; returns the array bytes.

    Arrays are hashed in background threads while the main thread writes them.
    """
    arrays, attrs = _flatten(tree)
    groups: dict[str, Any] = {"/": f}

    def group(name: str) -> Any:
        if name not in groups:
            groups[name] = f.require_group(name)
        return groups[name]

    for name, key, value in attrs:
        g = group(name)
        if key:
            g.attrs[key] = value
    with ThreadPoolExecutor(max_workers=_hash_threads()) as pool:
        digests = [pool.submit(sha256_of, arr) for _, arr in arrays]
        dsets = []
        for name, arr in arrays:
            parent, _, leaf = name.rpartition("/")
            dsets.append(group(parent or "/").create_dataset(leaf, data=arr))
        for dset, digest in zip(dsets, digests, strict=True):
            dset.attrs["sha256"] = digest.result()
    return sum(a.nbytes for _, a in arrays)


def save(
    directory: Path,
    *,
    step: int,
    epoch: int,
    model_config_json: str,
    tree: Mapping[str, Any],
    keep_last: int | None = None,
) -> SaveStats:
    """Write, fsync, rename and commit `step_<step>.h5`; then drop all but the newest `keep_last`.

    On any failure (no space left included) the temporary file is removed, the pointer and the
    previous checkpoints are untouched, and a CheckpointError names the path.
    """
    import h5py

    directory = Path(directory)
    final = directory / checkpoint_name(step)
    t0 = time.perf_counter()
    nbytes = 0
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(final) as tmp:
            with h5py.File(tmp, "w") as f:
                f.attrs["format"] = FORMAT
                f.attrs["format_version"] = FORMAT_VERSION
                f.attrs["step"] = int(step)
                f.attrs["epoch"] = int(epoch)
                f.attrs["model_config_json"] = str(model_config_json)
                f.attrs["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
                f.attrs["hpcdist_version"] = __version__
                nbytes = _write_tree(f, tree)
                f.flush()
        nbytes = final.stat().st_size
        write_pointer(directory, final.name)
    except OSError as exc:
        raise CheckpointError(_write_failure(final, exc)) from exc
    seconds = time.perf_counter() - t0
    removed = prune(directory, keep_last) if keep_last else ()
    return SaveStats(final, nbytes, seconds, removed)


def _write_failure(final: Path, exc: OSError) -> str:
    no_space = exc.errno == errno.ENOSPC or "No space left" in str(exc) or "errno = 28" in str(exc)
    what = "no space left on the device" if no_space else f"{type(exc).__name__}: {exc}"
    latest = read_pointer(final.parent)[0]
    kept = f"the committed checkpoint {latest} is intact" if latest else "no earlier checkpoint was committed"
    hint = "free space there or point storage.checkpoints elsewhere" if no_space else "check the directory"
    return f"writing checkpoint {final} failed: {what}; the temporary file was removed and {kept}; {hint}"


def write_pointer(directory: Path, name: str) -> None:
    """Commit `name`: atomically replace `<directory>/latest` with it."""
    with atomic_path(Path(directory) / POINTER) as tmp:
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()


def read_pointer(directory: Path) -> tuple[Path | None, str]:
    """The file `latest` names and, when there is none, why (empty, missing, dangling...)."""
    pointer = Path(directory) / POINTER
    try:
        text = pointer.read_text().strip()
    except FileNotFoundError:
        return None, f"{pointer} does not exist"
    except OSError as exc:
        return None, f"{pointer} cannot be read ({exc.strerror})"
    if not text:
        return None, f"{pointer} is empty"
    if not _NAME.match(text):
        return None, f"{pointer} holds {text[:60]!r}, not a checkpoint name like step_00000010.h5"
    target = Path(directory) / text
    if not target.is_file():
        return None, f"{pointer} points to {text}, which does not exist"
    return target, ""


def checkpoints_in(directory: Path) -> list[Path]:
    """Final-named checkpoint files in `directory`, newest step first (temporaries excluded)."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: step_of(p) or 0, reverse=True)


def temporaries_in(directory: Path) -> list[Path]:
    """Temporary files left in `directory` (a writer killed mid-write leaves one)."""
    if not Path(directory).is_dir():
        return []
    return sorted(p for p in Path(directory).iterdir() if is_temporary(p))


def prune(directory: Path, keep_last: int) -> tuple[Path, ...]:
    """Delete committed checkpoints older than the newest `keep_last`; never the committed one."""
    latest, _ = read_pointer(directory)
    if latest is None or keep_last < 1:
        return ()
    latest_step = step_of(latest) or 0
    older = [p for p in checkpoints_in(directory) if (step_of(p) or 0) <= latest_step]
    removed = []
    for path in older[keep_last:]:
        if path != latest:
            path.unlink(missing_ok=True)
            removed.append(path)
    return tuple(removed)


def remove_temporaries(directory: Path) -> list[Path]:
    """Remove temporaries left by killed writers (call only when no writer of this job runs)."""
    gone = []
    for path in temporaries_in(directory):
        path.unlink(missing_ok=True)
        gone.append(path)
    return gone


# ---------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """A checkpoint read back: root attributes and the tree of groups read."""

    path: Path
    attrs: dict[str, Any]
    tree: Tree
    bytes: int = 0
    seconds: float = 0.0

    @property
    def step(self) -> int:
        return int(self.attrs["step"])

    @property
    def epoch(self) -> int:
        return int(self.attrs["epoch"])

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else float("nan")


def plain(value: Any) -> Any:
    """An HDF5 attribute as a plain Python value (bytes decoded, NumPy scalars unwrapped)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


Check = tuple[str, "Future[str] | None", str]  # dataset name, its hash being computed, the recorded hash


def _read_tree(group: h5py.Group, pool: ThreadPoolExecutor | None, checks: list[Check]) -> tuple[Tree, int]:
    """The group as a tree; each dataset is hashed in `pool` (when verifying) while the rest is read."""
    import h5py

    out: Tree = {k: plain(v) for k, v in group.attrs.items()}
    nbytes = 0
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            out[key], n = _read_tree(item, pool, checks)
            nbytes += n
            continue
        arr = np.asarray(item[()])
        nbytes += arr.nbytes
        digest = pool.submit(sha256_of, arr) if pool is not None else None
        checks.append((item.name, digest, str(plain(item.attrs.get("sha256", "")))))
        out[key] = arr
    return out, nbytes


def _verify(path: Path, checks: list[Check]) -> None:
    for name, digest, expected in checks:
        if not expected:
            raise CheckpointError(f"{path}: dataset {name} has no sha256 attribute")
        if digest is not None and digest.result() != expected:
            raise CheckpointError(f"{path}: dataset {name} fails its sha256 check (data corrupted)")


def read(path: Path, *, groups: tuple[str, ...] | None = None, verify: bool = True) -> Checkpoint:
    """Root attributes and the named groups (all when None) of a checkpoint, checksums verified."""
    import h5py

    path = Path(path)
    t0 = time.perf_counter()
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: plain(v) for k, v in f.attrs.items()}
            _check_root(path, attrs)
            names = list(f.keys()) if groups is None else [g for g in groups if g in f]
            tree: Tree = {}
            nbytes = 0
            checks: list[Check] = []
            with ThreadPoolExecutor(max_workers=_hash_threads()) as pool:
                for name in names:
                    tree[name], n = _read_tree(f[name], pool if verify else None, checks)
                    nbytes += n
                if verify:
                    _verify(path, checks)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as HDF5 ({_short(exc)}); truncated or corrupt") from exc
    return Checkpoint(path, attrs, tree, nbytes, time.perf_counter() - t0)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def _check_root(path: Path, attrs: Mapping[str, Any]) -> None:
    missing = [a for a in _ROOT_ATTRS if a not in attrs]
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an hpcdist checkpoint (format {attrs.get('format')!r})")
    if missing:
        raise CheckpointError(f"{path}: root attributes missing: {', '.join(missing)}")
    if int(attrs["format_version"]) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {attrs['format_version']} is newer than this hpcdist reads "
            f"({FORMAT_VERSION}); upgrade hpcdist"
        )


def verify(path: Path) -> None:
    """Raise a CheckpointError saying why `path` cannot be trusted; return if every checksum holds."""
    read(path, verify=True)


@dataclass
class Scan:
    """What `scan` found: the checkpoint to resume from and those skipped, with reasons."""

    latest: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    pointer_problem: str = ""
    temporaries: list[Path] = field(default_factory=list)

    def report(self) -> list[str]:
        lines = []
        if self.pointer_problem:
            lines.append(f"checkpoint pointer: {self.pointer_problem}; falling back to the files present")
        lines += [f"skipping checkpoint {p}: {why}" for p, why in self.skipped]
        lines += [f"ignoring temporary {p} (a writer was killed mid-write)" for p in self.temporaries]
        return lines


def scan(directory: Path) -> Scan:
    """The newest committed checkpoint in `directory` whose checksums verify, and what was skipped."""
    directory = Path(directory)
    files = checkpoints_in(directory)
    temporaries = temporaries_in(directory)
    if not files:
        pointer, problem = read_pointer(directory)
        has_pointer = (directory / POINTER).exists()
        return Scan(None, pointer_problem=problem if has_pointer else "", temporaries=temporaries)
    pointer, problem = read_pointer(directory)
    skipped: list[tuple[Path, str]] = []
    if pointer is not None:
        limit = step_of(pointer) or 0
        for p in files:
            if (step_of(p) or 0) > limit:
                skipped.append((p, f"written after the last commit ({POINTER} names {pointer.name})"))
        candidates = [p for p in files if (step_of(p) or 0) <= limit]
    else:
        candidates = files
    for path in candidates:
        try:
            verify(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc).removeprefix(f"{path}: ")))
            continue
        return Scan(path, skipped, problem, temporaries)
    return Scan(None, skipped, problem, temporaries)


def find_latest(directory: Path, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest committed checkpoint that verifies; each skipped one is reported with why."""
    result = scan(directory)
    say = report or log.warning
    for line in result.report():
        say(line)
    return result.latest


# ---------------------------------------------------------------- model state


def load_model_state(path: Path, verify: bool = True) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The model config and a state dict ready for ``GPT.load_state_dict`` (strict).

    Tied keys omitted in the file (``lm_head.weight``) are restored as the same tensor as the
    key they are tied to.
    """
    import torch

    from hpcdist.model.gpt import GPTConfig

    ckpt = read(path, groups=("model",), verify=verify)
    if "model" not in ckpt.tree:
        raise CheckpointError(f"{path}: has no /model group")
    cfg = GPTConfig.model_validate_json(ckpt.attrs["model_config_json"])
    group = dict(ckpt.tree["model"])
    tied = json.loads(group.pop("tied_json", "{}") or "{}")
    state = {k: torch.from_numpy(np.array(v)) for k, v in group.items() if isinstance(v, np.ndarray)}
    for key, source in tied.items():
        state[key] = state[source]
    return cfg, state


def check_shapes(path: Path, expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> None:
    """A clear error listing every tensor whose shape (or presence) differs from the model's."""
    problems = []
    for key in sorted(set(expected) | set(found)):
        if key not in found:
            problems.append(f"{key}: missing in checkpoint (model has {list(expected[key])})")
        elif key not in expected:
            problems.append(f"{key}: in checkpoint {list(found[key])} but not in the model")
        elif tuple(expected[key]) != tuple(found[key]):
            problems.append(f"{key}: checkpoint {list(found[key])} vs model {list(expected[key])}")
    if problems:
        shown = "; ".join(problems)
        raise CheckpointError(
            f"{path} was written for a different model shape ({len(problems)} tensor(s) differ): {shown}; "
            f"use the same params.model as the run that wrote it, or a fresh checkpoint directory"
        )

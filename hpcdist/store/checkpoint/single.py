"""Checkpoint files on shared storage: HDF5 files that are never half-written where a reader looks.

Format ``hpcdist.checkpoint`` version 2 (readable by ``h5dump`` and by plain ``h5py``):

- Files ``<checkpoint dir>/step_<step:08d>.h5``. Each is written under a hidden temporary name in
  the same directory, flushed and fsynced, renamed onto its final name (``hpcdist.files.atomic``),
  and only then *committed* by atomically rewriting the pointer file ``<dir>/latest``, whose
  last line is the committed file's name (``step_00000120.h5``), after a line ``run <id>`` naming
  the run that committed it (``hpcdist.store.checkpoint.directory``). A reader trusts only committed files:
  the one ``latest`` names, or older ones of the same run. Files newer than the pointer (a
  writer killed between rename and commit) and files of another run are ignored.
- Root attributes: ``format = "hpcdist.checkpoint"``, ``format_version = 2``, ``step``,
  ``epoch``, ``created`` (UTC ISO 8601), ``hpcdist_version``, ``checksum`` (the algorithm of
  every digest in the file: ``xxh3-128`` by default, or ``sha256``; ``hpcdist.store.checksum``),
  ``run_id`` (the run that wrote it; absent from files of earlier builds and of writers that name
  no run), ``job_id`` (the job that wrote it, when known), and those the caller adds (the GPT
  layer adds ``model_config_json``, see ``hpcdist.model.checkpoint``).
- Root attribute ``index_json`` (optional: files of earlier hpcdist 0.1.0 builds lack it):
  the tree's groups, and for each numeric dataset its path, byte offset in the file, dtype,
  shape and digest (``hpcdist.store.checkpoint.rawio.TreeIndex``). Such datasets are contiguous and
  uncompressed, so a reader can read them without walking HDF5 objects; any disagreement
  between index and file sends the reader back to the HDF5 structure, which stays the truth.
- Below the root: the caller's tree (``hpcdist.store.checkpoint.tree``): groups, datasets each with a
  ``checksum`` attribute (``"xxh3-128:<hex>"``), attributes. A read verifies every dataset it
  reads. Nothing in the file is a pickle: plain values are HDF5 attributes or JSON.

Version 1 (hpcdist 0.1.0 before the change) differs only in its digests: a bare hex sha256 in
each dataset's ``sha256`` attribute, no root ``checksum``; its sharded checkpoints kept non-tensor
values as DCP's pickles (read now only as tensors and plain values: ``weights_only=True``).

Version rule (the one every reader applies, `check_root`): a file whose ``format_version`` is
newer than this hpcdist's is refused with "upgrade hpcdist"; versions 1 up to the current one
are read; anything else is not a checkpoint version. An hpcdist of format 1 meeting a format-2
file says in one line that it is newer than it reads.

The directory itself (naming, the pointer, listing, pruning, discovery) is
``hpcdist.store.checkpoint.directory``; ``CheckpointStore`` (``hpcdist.store``) ties both together.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist._version import __version__
from hpcdist.errors import CheckpointError
from hpcdist.files.atomic import atomic_path
from hpcdist.store import checksum as checksums
from hpcdist.store.checkpoint.directory import checkpoint_name, prune, read_pointer, write_pointer
from hpcdist.store.checkpoint.owned import drop_group_write, make_folder
from hpcdist.store.checkpoint.rawio import TreeIndex, write_tree
from hpcdist.store.checkpoint.rawread import read_indexed
from hpcdist.store.checkpoint.tree import DatasetInfo, Tree, attr_value, describe_group, plain, read_tree

FORMAT = "hpcdist.checkpoint"
FORMAT_VERSION = 2  # 2: digests name their algorithm (xxh3-128 by default), no pickle in sharded values
CHECKSUM_ATTR = checksums.ATTR  # root attribute: the algorithm of the file's digests (format 2)
ROOT_ATTRS = ("format", "format_version", "step", "epoch", "created")
RUN_ATTR = "run_id"  # root attribute: the run that wrote the file (`hpcdist.store.checkpoint.directory`)
JOB_ATTR = "job_id"  # root attribute: the job that wrote it (a requeue is the same job)
INDEX_ATTR = "index_json"  # optional: where each array lies (`TreeIndex`), for the fast read
# HDF5 gathers object headers in blocks of this size (2 KiB by default), so the arrays' bytes
# lie in a few long runs that the writer writes with one call each, not one per dataset
META_BLOCK_BYTES = 256 << 10
# The file format of HDF5 1.8 and later (superblock 2): it stores an attribute over 64 KiB (the
# index of a model with thousands of arrays) densely. In h5py's default, the 1.6 format (superblock
# 0), an HDF5 older than 2.0 refuses such an attribute. Every HDF5 since 1.8 (2008) reads the file.
LIBVER = "v108"


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


def save(
    directory: Path | str,
    step: int,
    tree: Mapping[str, Any],
    *,
    epoch: int = 0,
    attrs: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    run_id: str = "",
    job_id: str = "",
    before_commit: Callable[[], None] | None = None,
    checksum: str | None = None,
) -> SaveStats:
    """Write, fsync, rename and commit `step_<step>.h5`; then drop all but the newest `keep_last`
    of its run.

    `attrs` are extra root attributes; `run_id` (the run the commit belongs to) and `job_id` (the
    writer's job) are recorded in the file and the run in the pointer; `before_commit` runs once the
    bytes are durable, before the rename (the claim's check: it may refuse); `checksum` is the
    algorithm of the file's digests (``hpcdist.store.checksum.chosen()`` by default). On any failure (no space
    left included) the temporary file is removed, the pointer and the previous checkpoints are
    untouched, and a CheckpointError names the path.
    """
    import h5py

    directory = Path(directory)
    final = directory / checkpoint_name(step)
    algorithm = checksums.check_name(checksum) if checksum else checksums.chosen()
    t0 = time.perf_counter()
    try:
        make_folder(directory)  # never group- or world-writable: a run resumes only from what no one else wrote
        with atomic_path(final) as tmp:
            f = h5py.File(tmp, "w", libver=LIBVER, meta_block_size=META_BLOCK_BYTES)
            try:
                f.attrs["format"] = FORMAT
                f.attrs["format_version"] = FORMAT_VERSION
                f.attrs["step"] = int(step)
                f.attrs["epoch"] = int(epoch)
                for key, value in (attrs or {}).items():
                    f.attrs[key] = attr_value(value)
                f.attrs["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
                f.attrs["hpcdist_version"] = __version__
                f.attrs[CHECKSUM_ATTR] = algorithm
                if run_id:
                    f.attrs[RUN_ATTR] = run_id
                if job_id:
                    f.attrs[JOB_ATTR] = job_id
                index = write_tree(f, tree, raw=tmp, algorithm=algorithm)
                f.attrs[INDEX_ATTR] = index.to_json()
            except BaseException:
                with contextlib.suppress(Exception):
                    f.close()  # its flush fails too when the disk is full: report what stopped the write
                raise
            f.close()
            drop_group_write(tmp)
            if before_commit is not None:
                before_commit()
        nbytes = final.stat().st_size
        write_pointer(directory, final.name, run_id)
    except (OSError, RuntimeError) as exc:  # h5py reports a failed flush at close as RuntimeError
        raise CheckpointError(_write_failure(final, exc)) from exc
    seconds = time.perf_counter() - t0
    try:
        removed = prune(directory, keep_last, run_of) if keep_last else ()
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {final} is committed, but removing older checkpoints failed: {exc.strerror or exc} "
            f"({exc.filename or directory}); fix the permissions or space of {directory}"
        ) from exc
    return SaveStats(final, nbytes, seconds, removed)


def written_by(path: Path | str) -> tuple[str, str]:
    """(run id, job id) a checkpoint file records ("" for what it does not), without reading data."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return str(plain(f.attrs.get(RUN_ATTR, ""))), str(plain(f.attrs.get(JOB_ATTR, "")))
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise _open_failure(Path(path), exc) from exc


def run_of(path: Path | str) -> str:
    """The run a checkpoint file records ("" for a file of an earlier build)."""
    return written_by(path)[0]


def _write_failure(final: Path, exc: Exception) -> str:
    no_space = getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc) or "errno = 28" in str(exc)
    what = "no space left on the device" if no_space else f"{type(exc).__name__}: {exc}"
    latest = read_pointer(final.parent)[0]
    kept = f"the committed checkpoint {latest} is intact" if latest else "no earlier checkpoint was committed"
    hint = "free space there or point storage.checkpoints elsewhere" if no_space else "check the directory"
    return f"writing checkpoint {final} failed: {what}; the temporary file was removed and {kept}; {hint}"


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


def check_root(path: Path, attrs: Mapping[str, Any]) -> None:
    """The format and version rule every reader applies to a file's root attributes."""
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an hpcdist checkpoint (format {attrs.get('format')!r})")
    missing = [a for a in ROOT_ATTRS if a not in attrs]
    if missing:
        raise CheckpointError(f"{path}: root attributes missing: {', '.join(missing)}")
    version = attrs["format_version"]
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version} is newer than this hpcdist reads ({FORMAT_VERSION}); upgrade hpcdist"
        )
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: format_version {version!r} is not a version of {FORMAT}; the file is damaged")


def _open_failure(path: Path, exc: BaseException) -> CheckpointError:
    text = (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:200]
    return CheckpointError(f"{path}: cannot be read as HDF5 ({text}); truncated or corrupt")


def read(path: Path | str, *, groups: tuple[str, ...] | None = None, verify: bool = True,
         mapped: bool = False) -> Checkpoint:
    """Root attributes and the named groups (all when None) of a checkpoint, checksums verified;
    with `mapped`, its arrays are copy-on-write views of the file (``rawread.read_indexed``)."""
    import h5py

    path = Path(path)
    t0 = time.perf_counter()
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: plain(v) for k, v in f.attrs.items()}
            check_root(path, attrs)
            names = list(f.keys()) if groups is None else [g for g in groups if g in f]
            index = attrs.pop(INDEX_ATTR, None)
            try:
                if not isinstance(index, str):
                    raise CheckpointError(f"{path}: no index")
                tree, nbytes = read_indexed(f, path, TreeIndex.from_json(index), names, verify=verify, where=path,
                                            mapped=mapped)
            except (CheckpointError, OSError, KeyError, ValueError, TypeError):
                # no index (an older file) or one that disagrees with the file: HDF5 is the truth
                tree, nbytes = read_tree({name: f[name] for name in names}, verify=verify, where=path)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise _open_failure(path, exc) from exc
    return Checkpoint(path, attrs, tree, nbytes, time.perf_counter() - t0)


def verify(path: Path | str) -> None:
    """Raise a CheckpointError saying why `path` cannot be trusted; return if every checksum holds."""
    read(path, verify=True)


@dataclass(frozen=True)
class Header:
    """A checkpoint's root attributes and one group's datasets, described without reading data."""

    path: Path
    attrs: dict[str, Any]
    datasets: dict[str, DatasetInfo] | None  # None when the file has no such group


def read_header(path: Path | str, group: str) -> Header:
    """Root attributes (format and version checked) and the datasets of `group`, no data read."""
    import h5py

    path = Path(path)
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: plain(v) for k, v in f.attrs.items()}
            check_root(path, attrs)
            g = f.get(group)
            return Header(path, attrs, describe_group(g) if isinstance(g, h5py.Group) else None)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise _open_failure(path, exc) from exc


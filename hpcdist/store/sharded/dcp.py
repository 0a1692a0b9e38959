"""hpcdist checkpoints to and from ``torch.distributed.checkpoint``'s own folder format
(``FileSystemWriter``: ``.metadata`` and ``__<rank>_<n>.distcp`` files), which torchtitan,
Lightning and plain ``dcp.save`` / ``dcp.load`` read and write (``hpcdist.store.sharded.checkpoint``).

Both run in one process, the whole state passing through its memory: for a state too big for
that, read ours in place with ``dcp.load(state, storage_reader=ShardedReader(INDEX))``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def export_dcp(checkpoint: Path, output: Path) -> tuple[Path, int]:
    """`checkpoint` (a file or a directory's latest) written as DCP folder `output`; (the file, its
    top-level entries). Groups go as nested dicts, numeric arrays as tensors: an unsharded
    checkpoint's all, a sharded one's index values (a trainer's sampler, scheduler) and shards."""
    from hpcdist.errors import ConfigError
    from hpcdist.store.checkpoint.discovery import resolve
    from hpcdist.store.checkpoint.single import read, read_header
    from hpcdist.store.sharded import checkpoint as sharded

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

    from hpcdist.store.sharded.checkpoint import one_error

    output.mkdir(parents=True, exist_ok=True)
    with one_error():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(output)), no_dist=True)


def import_dcp(directory: Path, output: Path, step: int, report: Callable[[str], None] | None = None) -> Any:
    """DCP folder `directory` committed as step `step` of checkpoint directory `output`; its SaveStats.

    A writer like any run's: it claims `output` (a live run's directory is refused, naming it), and
    commits as a new run, the checkpoints already there first set aside into ``previous/`` (said in
    one line to `report`), so no run resumes, prunes or mixes with the imported step."""
    from hpcdist.errors import CheckpointError
    from hpcdist.store.checkpoint.manager import CheckpointStore
    from hpcdist.store.sharded import checkpoint as sharded

    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"{directory} is not a dcp.save folder (it has no .metadata); give the folder "
                              f"torch.distributed.checkpoint.save wrote")
    if step < 0:
        raise CheckpointError(f"--step {step} is negative; give a step of 0 or more")
    store = CheckpointStore(output, report=report)
    claim = store.claim()
    try:
        run = store.start_run(f"import-dcp of {directory}")
        with sharded.one_error(), _single_process():
            return sharded.import_dcp(directory, output, step, identity=lambda: store.commit_identity(run))
    finally:
        claim.release()


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP without a process group, quietly: its warning that it assumes one process is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

"""Files on shared storage (node side writes them, both sides read them): atomic writes, HDF5 trees
with checksums, checkpoints and results.

Model-agnostic: state goes in and comes out as nested dicts of tensors, NumPy arrays and plain
values; neither torch nor any workload module is imported here (tensors are converted where
they are met). The GPT's own checkpoint knowledge lives in ``hpcdist.model.checkpoint``.

- ``atomic``: temporary name in the same directory, fsync, ``os.replace``, directory fsync;
- ``checksum``: the digest of every array (XXH3-128 by default, sha256 by choice) and its check;
- ``values``: plain values as JSON, never a pickle; format 1's pickles read as data only;
- ``tree``: nested dict <-> HDF5 group, a digest of every array, the HDF5-attribute converters,
  reading through HDF5 with every digest checked;
- ``rawio``: writing a tree, a checkpoint's arrays by ``os.pwrite``/``os.preadv`` and its index,
  the host-memory snapshot an asynchronous save takes;
- ``directory``: step names, the ``latest`` pointer and the run it names, listing, retention,
  temporaries, setting an earlier run's files aside;
- ``checkpoints``: the ``hpcdist.checkpoint`` format: save (commit), read and verify, headers;
- ``discovery``: the newest committed checkpoint that verifies, with reasons for each one skipped;
- ``manager``: ``CheckpointStore``, one directory as an object (the public checkpoint API);
- ``sharded`` (with ``sharded_storage``, ``sharded_layout``): sharded state through DCP's storage
  layer;
- ``results``: the versioned ``hpcdist.result`` files;
- ``dcp``: checkpoints to and from DCP's own folders (``hpcdist ckpt``);
- ``stackrecord``: a rank's stack file in the job's folder, and the grouping both sides print.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcdist.store.atomic import atomic_path, fsync_path
    from hpcdist.store.checkpoints import Checkpoint, Header, SaveStats, read, read_header, save, verify
    from hpcdist.store.directory import checkpoints_in, read_pointer, step_of
    from hpcdist.store.discovery import Scan, find_latest, resolve, scan
    from hpcdist.store.manager import CheckpointStore
    from hpcdist.store.tree import Tree, plain, sha256_of

# Each name's module, imported on first use (PEP 562): the login node's light modules use
# ``hpcdist.store.atomic`` without paying for h5py and NumPy (tests/test_light_imports.py).
_HOME = {
    "atomic": ("atomic_path", "fsync_path"),
    "checkpoints": ("Checkpoint", "Header", "SaveStats", "read", "read_header", "save", "verify"),
    "directory": ("checkpoints_in", "read_pointer", "step_of"),
    "discovery": ("Scan", "find_latest", "resolve", "scan"),
    "manager": ("CheckpointStore",),
    "tree": ("Tree", "plain", "sha256_of"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcdist.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpcdist.store.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "Header",
    "SaveStats",
    "Scan",
    "Tree",
    "atomic_path",
    "checkpoints_in",
    "find_latest",
    "fsync_path",
    "plain",
    "read",
    "read_header",
    "read_pointer",
    "resolve",
    "save",
    "scan",
    "sha256_of",
    "step_of",
    "verify",
]

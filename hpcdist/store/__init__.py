"""Files on shared storage (node side writes them, both sides read them): atomic writes, HDF5 trees
with checksums, checkpoints and results.

Model-agnostic: state goes in and comes out as nested dicts of tensors, NumPy arrays and plain
values; neither torch nor any workload module is imported here (tensors are converted where
they are met). The GPT's own checkpoint knowledge lives in ``hpcdist.model.checkpoint``.

A folder per concern (tests/test_layout.py keeps them apart); beside them what all of them use
(files written whole and read only from places no one else could write are ``hpcdist.files``'s,
below the store: the site config and the login node's records use them too):

- ``checksum``: the digest of every array (XXH3-128 by default, sha256 by choice) and its check;
- ``hostmem``: host memory marks and the pinned staging of an asynchronous save;
- ``checkpoint/``: the ``hpcdist.checkpoint`` format and what every checkpoint shares: ``values``
  (plain values as JSON, never a pickle), ``tree`` (nested dict <-> HDF5 group, digests),
  ``rawio`` (arrays by ``os.pwrite``, the index), ``rawread`` (arrays back by
  ``os.preadv``), ``staging`` (an asynchronous save's host copy), ``directory`` (steps, the
  ``latest`` pointer, runs, retention), ``single`` (save, commit, read, verify, headers),
  ``discovery`` (the newest committed step that verifies), ``manager`` (``CheckpointStore``),
  ``claim`` (one writer per directory), ``collective`` (tensor-only collectives), ``owned``
  (a run resumes only from checkpoints no one else could have written);
- ``sharded/``: sharded state through DCP's storage layer: ``checkpoint``, ``storage``,
  ``layout``, ``replicas`` (which rank writes a replicated value), ``node_read`` (each byte read
  and verified once per node), ``dcp`` (DCP's own folders);
- ``results/``: the versioned ``hpcdist.result`` files, and ``compare`` (``report --compare``);
- ``records/``: the site's shared records: ``health``, ``node_failures``, ``stackrecord`` (a rank's
  stack file and the grouping both sides print), ``last_error`` (a rank's last words).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcdist.store.checkpoint.directory import checkpoints_in, read_pointer, step_of
    from hpcdist.store.checkpoint.discovery import Scan, find_latest, resolve, scan
    from hpcdist.store.checkpoint.manager import CheckpointStore
    from hpcdist.store.checkpoint.single import Checkpoint, Header, SaveStats, read, read_header, save, verify
    from hpcdist.store.checkpoint.tree import Tree, plain, sha256_of

# Each name's module, imported on first use (PEP 562): the login node's light modules use
# ``hpcdist.store.records`` without paying for h5py and NumPy (tests/test_light_imports.py).
_HOME = {
    "checkpoint.single": ("Checkpoint", "Header", "SaveStats", "read", "read_header", "save", "verify"),
    "checkpoint.directory": ("checkpoints_in", "read_pointer", "step_of"),
    "checkpoint.discovery": ("Scan", "find_latest", "resolve", "scan"),
    "checkpoint.manager": ("CheckpointStore",),
    "checkpoint.tree": ("Tree", "plain", "sha256_of"),
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
    "checkpoints_in",
    "find_latest",
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

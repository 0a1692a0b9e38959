"""Test hook: a training job that commits a newer checkpoint right after anyone reads `latest`.

On PYTHONPATH with HPCDIST_TEST_COMMIT_ON_RESOLVE=DIR, every process (the ranks of a local job
included) wraps the pointer read of hpcdist's checkpoint discovery: after each read of DIR's
``latest``, the next pre-written step in DIR is committed. Two ranks that each resolve ``latest``
then see different steps, deterministically; ranks that share rank 0's one resolution do not.
"""

import os

_DIR = os.environ.get("HPCDIST_TEST_COMMIT_ON_RESOLVE")
if _DIR:
    import fcntl
    from pathlib import Path

    from hpcdist.store.checkpoint import directory, discovery
    _read = discovery.read_pointer

    def _read_then_commit(path: Path) -> tuple[Path | None, str]:
        if Path(path).resolve() != Path(_DIR).resolve():
            return _read(path)
        with open(Path(_DIR) / ".hook-lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # read and commit as one step: no two readers see one step
            found = _read(path)
            if found[0] is not None:
                newer = directory.checkpoint_name((directory.step_of(found[0]) or 0) + 1)
                if (Path(path) / newer).exists():
                    directory.write_pointer(Path(path), newer)
        return found

    discovery.read_pointer = _read_then_commit

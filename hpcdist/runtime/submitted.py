"""Each rank's task runner: submitit's (``submitit.core._submit``), behind hpcdist's trust check.

submitit unpickles ``<folder>/<job id>_submitted.pkl`` and runs it; on shared storage that file
must be one no other user could have written (``hpcdist.store.trust``), or whoever replaced it
runs code as this user. Refused, the rank prints one line and exits 1, with nothing unpickled.
The rank's result pickle is written 0600 (the return value is the user's alone), whatever
``storage.mode`` says for the job's other files.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from hpcdist.store.atomic import storage_umask

WAIT_S = 60  # submitit waits as long for a pickle not yet visible on the node (shared storage lags)


def _private_dump(dump: Callable[..., Any]) -> Callable[..., Any]:
    def private(obj: Any, filename: Any) -> Any:
        with storage_umask(0o077):
            return dump(obj, filename)

    return private


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcdist.runtime.submitted FOLDER", file=sys.stderr)
        return 2
    folder = args[0]
    os.environ["SUBMITIT_FOLDER"] = folder
    from submitit.core import job_environment, submission

    from hpcdist.store.trust import UntrustedFileError, trusted

    pickle = job_environment.JobEnvironment().paths.submitted_pickle
    deadline = time.monotonic() + WAIT_S
    while not pickle.exists() and time.monotonic() < deadline:
        time.sleep(1)
    try:
        trusted(pickle)
    except FileNotFoundError:
        print(f"hpcdist: error: {pickle} did not appear within {WAIT_S} s; the shared storage may lag or the "
              f"job's folder was removed: submit it again", file=sys.stderr, flush=True)
        return 1
    except UntrustedFileError as exc:
        print(f"hpcdist: error: {exc}", file=sys.stderr, flush=True)
        return 1
    submission.utils.cloudpickle_dump = _private_dump(submission.utils.cloudpickle_dump)
    submission.process_job(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

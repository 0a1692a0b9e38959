"""Each rank's task runner: submitit's (``submitit.core._submit``), behind hpcdist's trust check.

submitit unpickles ``<folder>/<job id>_submitted.pkl`` and runs it; on shared storage that file
must be one no other user could have written (``hpcdist.files.trust``), or whoever replaced it
runs code as this user. Refused, the rank prints one line and exits 1, with nothing unpickled.
The rank's result pickle is written 0600 (the return value is the user's alone), whatever
``storage.mode`` says for the job's other files.

In a container, the image's Python, hpcdist and torch are compared first with those that
submitted the job (``HPCDIST_SUBMITTED_WITH``): another Python minor version or another hpcdist
cannot read what was pickled, and the rank says so in one line naming both; another torch is
said and the rank goes on (the image's torch is what the job asked for).

In a job with spare nodes the task runner is also the rank's end of the in-job supervisor's line
(``hpcdist.runtime.in_job_link``): a rank started again alone takes the rank it replaces before
anything reads it, and a rank whose job failed because another rank died runs it again in this
process when its supervisor says so.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hpcdist.config.contract import CALL_JOB_VAR
from hpcdist.files.atomic import storage_umask

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec

WAIT_S = 60  # submitit waits as long for a pickle not yet visible on the node (shared storage lags)


def _private_dump(dump: Callable[..., Any]) -> Callable[..., Any]:
    """submitit's result writer, 0600; a return value that cannot be pickled said as hpcdist says it
    (submitit then writes that error as the task's result)."""
    def private(obj: Any, filename: Any) -> Any:
        with storage_umask(0o077):
            try:
                return dump(obj, filename)
            except Exception as exc:
                if not (isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "success"):
                    raise
                value = obj[1]
                from hpcdist.errors import JobError

                with contextlib.suppress(OSError):  # the half-written file would stop submitit writing the error
                    os.unlink(filename)

                rank = os.environ.get("SLURM_PROCID", os.environ.get("SUBMITIT_LOCAL_GLOBALID", "0"))
                raise JobError(f"rank {rank}: its return value, a {type(value).__module__}.{type(value).__qualname__}, "
                               f"cannot be pickled to travel back ({type(exc).__name__}: {exc}); return plain "
                               f"data (numbers, strings, lists, dicts, tensors, arrays)") from exc

    return private


def _code_dir() -> None:
    """A direct Executor call's code snapshot (``HPCDIST_CODE_DIR``), checked as the ``python``
    kind checks it (UntrustedFileError), first on ``sys.path`` before submitit unpickles the call."""
    folder = os.environ.get("HPCDIST_CODE_DIR")
    if not folder:
        return
    from hpcdist.files.trust import trusted_tree

    trusted_tree(folder)
    sys.path.insert(0, folder)


def call_job(env: Mapping[str, str]) -> tuple[JobSpec, Site] | None:
    """A direct Executor call's spec and site, from the 0600 file ``HPCDIST_CALL_JOB`` names (an
    array's tasks: ``%a``, its ``SLURM_ARRAY_TASK_ID``); None in any other task."""
    path = env.get(CALL_JOB_VAR, "").replace("%a", env.get("SLURM_ARRAY_TASK_ID", "0"))
    if not path:
        return None
    import json

    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec
    from hpcdist.files.trust import read_trusted

    data = json.loads(read_trusted(path, private=True))
    return JobSpec.model_validate(data["spec"]), Site.model_validate(data["site"])


def _caches() -> None:
    """A direct Executor call has no bootstrap: its rank's caches and TMPDIR are set here, from its
    site, before submitit unpickles the call (``hpcdist.runtime.caches``)."""
    called = call_job(os.environ)
    if called is not None:
        from hpcdist.runtime import caches

        caches.for_rank(called[0].paths(called[1]))


def version_mismatch(submitted: str, here: dict[str, str]) -> tuple[str, str]:
    """(error, warning) comparing ``python=X hpcdist=Y torch=Z`` with `here`; "" where they agree."""
    there = dict(item.split("=", 1) for item in submitted.split() if "=" in item)
    python, ours = there.get("python", ""), here["python"]
    if python and python.split(".")[:2] != ours.split(".")[:2]:
        return (f"the image's Python {ours} cannot run this job, submitted with Python {python} (submitit's pickle "
                f"holds code for that version); run an image with Python {'.'.join(python.split('.')[:2])}, or "
                f"submit from a Python {'.'.join(ours.split('.')[:2])}", "")
    if there.get("hpcdist") and there["hpcdist"] != here["hpcdist"]:
        return (f"the image has hpcdist {here['hpcdist']}, the job was submitted with hpcdist {there['hpcdist']}; "
                f"install the same hpcdist in the image (docs/containers.md)", "")
    if there.get("torch") and there["torch"] != here["torch"]:
        return "", f"the image has torch {here['torch']}, the submitting side torch {there['torch']}: the image's runs"
    return "", ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check_only = args[:1] == ["--check"]  # the job script, outside a container: the pickle's real owners
    args = args[1:] if check_only else args
    if len(args) != 1:
        print("usage: python -m hpcdist.runtime.task_runner [--check] FOLDER", file=sys.stderr)
        return 2
    folder = args[0]
    if not check_only:
        from hpcdist.runtime import in_job_link

        in_job_link.adopt(os.environ)  # a rank started again alone takes the rank it replaces
        in_job_link.report_in(folder)  # a job with spare nodes: its supervisor watches this process's connection
    from hpcdist.files.trust import importable_cwd

    sys.path[:0] = importable_cwd()  # `python -m`'s first entry, which -P left off, where no one else writes it
    from hpcdist.containers import CONTAINER_VAR, SUBMITTED_WITH_VAR, versions

    if os.environ.get(CONTAINER_VAR) and os.environ.get(SUBMITTED_WITH_VAR) and not check_only:
        error, warning = version_mismatch(os.environ[SUBMITTED_WITH_VAR], versions())
        if error:
            print(f"hpcdist: error: {error}", file=sys.stderr, flush=True)
            return 1
        if warning and os.environ.get("SLURM_PROCID", "0") == "0":
            print(f"hpcdist: warning: {warning}", file=sys.stderr, flush=True)
    os.environ["SUBMITIT_FOLDER"] = folder
    from submitit.core import job_environment, submission

    from hpcdist.files.trust import UntrustedFileError, load_pickle, trusted

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
    if check_only:
        return 0
    try:
        _code_dir()
        _caches()
    except UntrustedFileError as exc:
        print(f"hpcdist: error: {exc}", file=sys.stderr, flush=True)
        return 1
    submission.utils.cloudpickle_dump = _private_dump(submission.utils.cloudpickle_dump)
    submission.utils.pickle_load = lambda filename: load_pickle(filename)  # read from what was checked
    _process(folder, submission.process_job)
    in_job_link.done()
    leave(0)
    return 0


def _process(folder: str, process_job: Callable[[str], None]) -> None:
    """submitit's run of the job; again in this process, under the next restart number, where the
    job's supervisor starts it again in place (``hpcdist.runtime.in_job_link``: another rank's
    process died on a live node, and only that one is started anew)."""
    from hpcdist.config.contract import IN_JOB_RESTART_VAR, RERUN_VAR, in_job_restarts
    from hpcdist.errors import cause_text, chain
    from hpcdist.runtime import in_job_link, teardown

    started = dict(os.environ)  # what the job sets (MASTER_ADDR of its store, RANK, ...) is undone before it runs again
    reruns = 0  # how often the job ran in this process before: hpcdist.Context's `reruns`
    while True:
        try:
            process_job(folder)
            return
        except Exception as exc:
            if not in_job_link.supervised():
                raise
            failure, comm = exc, in_job_link.communication_failure(exc)
            for cur in chain(exc):  # their frames would keep the failed run's groups and connections alive
                cur.__traceback__ = None
        teardown.drop()  # a group still registered (the script's own, hpcdist.init's) is no garbage
        gc.collect()  # the failed run's process groups freed: their sockets close, and a peer waiting in one fails now
        print(f"hpcdist: rank {os.environ.get('SLURM_PROCID', '?')}'s job failed ("
              f"{'a communication' if comm else 'its own'} error): {cause_text(failure)[:300]}",
              file=sys.stderr, flush=True)
        restart = in_job_link.again(comm, in_job_restarts(os.environ))
        if restart is None:
            raise failure  # its traceback is in the rank's log and result already
        reruns += 1
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:  # torch.compile's caches and guards hold the failed run's modules and groups
            dynamo.reset()
        os.environ.clear()
        os.environ.update({**started, IN_JOB_RESTART_VAR: str(restart), RERUN_VAR: str(reruns)})
        print(f"hpcdist: rank {os.environ.get('SLURM_PROCID', '?')} runs the job again in its process "
              f"(in-job restart {restart})", file=sys.stderr, flush=True)


def leave(code: int) -> None:
    """The task's result is written (submitit renamed it into place): the process ends without
    the interpreter's finalization, where a backend's threads (gloo's) can still abort it
    (SIGABRT) after it succeeded, which srun then reports as a failed step of a job whose every
    rank returned. atexit handlers, MPI's finalize (which mpirun waits for), logging and the
    standard streams are run and flushed first."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # mpi4py finalizes MPI at the C level of exit, which os._exit skips
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

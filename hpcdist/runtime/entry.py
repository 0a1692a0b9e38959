"""The function every rank runs: the bootstrap (``hpcdist.runtime.bootstrap``), then the job kind.

``run_rank`` is what each task runs (submitit pickles and calls ``hpcdist.runtime.run_rank``, which
imports this module on the node). ``main`` is the same thing for a direct launch
(``srun python -m hpcdist.runtime.entry JOB.yaml --site SITE``).

The one import that climbs from the runtime to the job kinds (``hpcdist.kinds.registry``, shared
with ``node_failure``'s policy): the rank's entry point is where a bootstrapped rank is handed to
its kind, and it keeps the documented name ``python -m hpcdist.runtime.entry``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any

from hpcdist import progress, track
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec
from hpcdist.errors import HpcdistError
from hpcdist.kinds.registry import Job, resolve
from hpcdist.runtime import abort, group, in_job_link, stacks, teardown
from hpcdist.runtime.bootstrap import bootstrap
from hpcdist.runtime.job_rank import JobRank

log = logging.getLogger("hpcdist")


def run_rank(spec: JobSpec, site: Site) -> dict[str, Any]:
    """What submitit calls on every rank: the spec's params parsed once here, then ``run_job``."""
    return run_job(resolve(spec, site, check=False), site)


def run_job(job: Job[Any], site: Site) -> dict[str, Any]:
    """Run `job` on this rank; returns this rank's summary (rank 0's names the result file)."""
    spec = job.spec
    os.environ.update(spec.rank_env(site))
    os.environ.update(track.environment(spec, site))  # the job's tracker run, for a script's own clients
    os.umask(site.storage.umask)  # storage.mode for all this rank writes (a direct launch has the shell's umask)
    from hpcdist.store import checksum

    checksum.use_site(site.storage.checksum)  # the checkpoints' digest, unless the job's HPCDIST_CHECKSUM names one
    try:
        ctx = bootstrap(spec, site, uses_mpi=job.uses_mpi, makes_group=job.makes_group)
    except BaseException as exc:
        stacks.on_failure(exc)  # a rendezvous that timed out: every rank's stack first
        raise
    store = ctx.store
    # what `hpcdist wait` shows, where the waiter of this very task reads it
    progress.start(ctx.paths.progress, ctx.is_main)
    import torch.distributed as dist  # already imported by the bootstrap, which times it

    try:
        try:
            out = job.kind.load_runner()(ctx, job.params) or {}
        except BaseException as exc:
            stacks.on_failure(exc)  # a collective that timed out: every rank's stack, before the others stop
            if in_job_link.supervised():  # the survivors still waiting on this rank fail now, not in 2 s
                teardown.drop(exc)
            _check_out_failed(store, ctx)
            raise
        if not group.finish(store, ctx.info, ctx.timeout_s):
            teardown.leave()  # every gloo worker idle before the interpreter finalizes (SIGABRT otherwise)
    finally:
        stacks.stop()
        abort.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"rank": ctx.rank, "host": ctx.info.hostname, "timings": ctx.timings, **out}


def _check_out_failed(store: Any, ctx: JobRank, wait_s: float = 2.0) -> None:
    """A failed rank still checks out, so rank 0 does not wait the full timeout for it.

    Best effort and bounded: when the failure is a lost link to rank 0, the store request would
    block until the store's own timeout and hold back the rank's error, so it runs in a daemon
    thread that this rank stops waiting for after `wait_s`.
    """

    def check_out() -> None:
        try:
            group.check_out(store, ctx.info, failed=True)
        except Exception:  # the store's server (rank 0) may be gone already
            pass

    thread = threading.Thread(target=check_out, name="hpcdist-check-out", daemon=True)
    thread.start()
    thread.join(wait_s)


def main(argv: list[str] | None = None) -> int:
    """Direct launch: every rank loads the spec and site itself."""
    from hpcdist.config import DEFAULT_SITE, load_site
    from hpcdist.kinds.registry import load_job

    parser = argparse.ArgumentParser(prog="python -m hpcdist.runtime.entry")
    parser.add_argument("job")
    parser.add_argument("--site", default=None)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        # no site named: the local site's, as before an allocation's ranks each read the cluster
        ref = args.site or os.environ.get("HPCDIST_SITE") or DEFAULT_SITE
        site = load_site(ref, [s[5:] for s in args.sets if s.startswith("site.")])
        job = load_job(args.job, site, [s for s in args.sets if not s.startswith("site.")])
        out = run_job(job, site)
    except HpcdistError as exc:
        print(f"hpcdist: error: {exc}", file=sys.stderr)
        return 1
    if out.get("rank") == 0:
        print({k: v for k, v in out.items() if k != "timings"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

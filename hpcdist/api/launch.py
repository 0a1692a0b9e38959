"""``init``: this rank's ``Context``, the handles on the one context the bootstrap returns.

There is one bootstrap (``hpcdist.runtime.bootstrap``) and one context per rank: in a hpcdist job
the runtime ``attach``es the bootstrap's ``JobRank`` before the user's code runs and ``detach``es
after, and ``from_job`` puts the handles on it (a built-in job kind calls it directly); outside a
job, ``_standalone`` runs the same bootstrap on a ``python`` spec of the script and the named site
(the ``local`` site's storage where none is named), using a group env:// already made as it is.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpcdist.api.context import CURRENT, Context

if TYPE_CHECKING:
    from hpcdist.config.site import Site
    from hpcdist.runtime.job_rank import JobRank

_ACTIVE: list[JobRank] = []  # the python job's bootstrap on this rank, when there is one
DEFAULT_TIMEOUT_S = 120.0


def attach(ctx: JobRank) -> None:
    """Make `ctx` (a ``python`` job's bootstrap on this rank) what ``init`` builds on."""
    _ACTIVE[:] = [ctx]


def detach(ok: bool) -> None:
    """End of the python job's code on this rank: close a context it left open (write its
    results) when the code succeeded; after a failure or a requeue only release the claim."""
    if CURRENT:
        if ok:
            CURRENT[0].close()
        else:
            CURRENT[0].release()
            CURRENT.clear()
    _ACTIVE.clear()


def init(*, site: str | None = None, name: str | None = None, timeout_s: float | None = None,
         checkpoint_dir: str | Path | None = None, keep_last: int | None = 3,
         io_timeout_s: float | None = None, checksum: str | None = None) -> Context:
    """This rank's Context, made once per process (later calls return the same one).

    `site` (or $HPCDIST_SITE) names the site whose storage and preemption signal to use outside
    an hpcdist job; `name` defaults to the script's name; `checkpoint_dir` overrides the job's
    ``<checkpoints>/<name>``; `keep_last` committed checkpoints are kept (None: all);
    `io_timeout_s` is how long ranks wait for rank 0's checkpoint I/O (default 30 minutes);
    `checksum` is the digest its checkpoints record (``xxh3-128``, the default, or ``sha256``).
    """
    if checksum is not None:
        from hpcdist.store import checksum as checksums

        checksums.use(checksum)
    if CURRENT:
        if CURRENT[0].implicit:  # made by the runner before an Executor function's own call: its arguments count
            _adopt(CURRENT[0], site=site, name=name, timeout_s=timeout_s, checkpoint_dir=checkpoint_dir,
                   keep_last=keep_last, io_timeout_s=io_timeout_s)
        return CURRENT[0]
    if _ACTIVE:
        ctx = from_job(_ACTIVE[0], checkpoint_dir, keep_last, io_timeout_s=io_timeout_s)
    else:
        ctx = _standalone(site, name, timeout_s, checkpoint_dir, keep_last)
        ctx.io_timeout_s = io_timeout_s
    CURRENT.append(ctx)
    return ctx


def for_call() -> Context:
    """The context an ``hpcdist.Executor`` function runs in (its group made before it is called):
    the function's own first ``init(...)`` still sets its checkpoint arguments (``_adopt``)."""
    ctx = init()
    ctx.implicit = True
    return ctx


def _adopt(ctx: Context, *, site: str | None, name: str | None, timeout_s: float | None,
           checkpoint_dir: str | Path | None, keep_last: int | None, io_timeout_s: float | None) -> None:
    """An Executor function's first ``init(...)``: its checkpoint arguments apply as in a script;
    what the job was submitted with (site, name, timeout) is refused, naming the executor's keyword."""
    from hpcdist.errors import ConfigError

    ctx.implicit = False
    _refuse_changed({"site": (site, ctx.site_name), "name": (name, ctx.name), "timeout_s": (timeout_s, ctx.timeout_s)})
    if ctx._checkpoints is not None and (checkpoint_dir is not None or keep_last != ctx._keep_last):
        raise ConfigError(f"hpcdist.init(checkpoint_dir={checkpoint_dir!r}, keep_last={keep_last!r}) after the "
                          f"function used ctx.checkpoints (in {ctx._checkpoint_dir}); call hpcdist.init(...) "
                          f"with these arguments before the first use of ctx.checkpoints")
    if checkpoint_dir is not None:
        ctx._checkpoint_dir = Path(checkpoint_dir)
    ctx._keep_last = keep_last
    if io_timeout_s is not None:
        ctx.io_timeout_s = io_timeout_s


def from_job(job: JobRank, checkpoint_dir: str | Path | None, keep_last: int | None,
             log: logging.Logger | None = None, io_timeout_s: float | None = None) -> Context:
    """In a hpcdist job: the handles on the bootstrap's context; the group made on its store
    unless the job kind made it. `log`: the job's logger (a built-in kind's), else ``hpcdist.user``."""
    import torch.distributed as dist

    from hpcdist.runtime import group

    own = not dist.is_initialized()
    if own:
        group.init_process_group(job.store, job.info, job.backend, job.timeout_s, job.device)
    return Context(job, checkpoint_dir=checkpoint_dir, keep_last=keep_last, own_group=own, log=log,
                   io_timeout_s=io_timeout_s)


def _standalone(site_ref: str | None, name: str | None, timeout_s: float | None,
                checkpoint_dir: str | Path | None, keep_last: int | None) -> Context:
    """Outside an hpcdist job: the same bootstrap as a job's, on a ``python`` spec of this script
    and the named site (the ``local`` site's storage where none is named)."""
    import torch
    import torch.distributed as dist

    from hpcdist.config import DEFAULT_SITE, load_site, validate
    from hpcdist.config.spec import JobSpec
    from hpcdist.runtime.bootstrap import bootstrap

    env = dict(os.environ)
    called = _called_job(env, site_ref, name, timeout_s)  # inside a direct hpcdist.Executor call
    if called is not None:
        name, timeout_s, site = called
        site_ref = site.name
    elif site_ref := site_ref or env.get("HPCDIST_SITE"):
        site = load_site(site_ref)
    if site_ref:
        os.umask(site.storage.umask)  # what this script writes to the site's storage gets storage.mode
        from hpcdist.files import roots
        from hpcdist.store import checksum

        checksum.use_site(site.storage.checksum)
        roots.ready(site.storage, site.name)
    else:  # the default site's storage; the preemption signal submitit would use
        signal = env.get("SUBMITIT_PREEMPTION_SIGNAL", "USR2").removeprefix("SIG")
        site = load_site(DEFAULT_SITE, [f"preemption.signal={signal}"])  # never discovered again on each rank
    own = not dist.is_initialized()
    spec = validate(JobSpec, {
        "name": name or default_name(), "kind": "python",
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
        "timeout_s": timeout_s or site.defaults.timeout_s or DEFAULT_TIMEOUT_S,
    }, "hpcdist.init")
    job = bootstrap(spec, site, env, standalone=True, shared_scratch=bool(site_ref))
    job.run_id = job.info.job_id or _launcher_run_id(env) or _new_local_id(job.world_size)
    ctx = Context(job, checkpoint_dir=checkpoint_dir, keep_last=keep_last, own_group=own)
    atexit.register(_release_at_exit, ctx)
    ctx.log.info("hpcdist.init: rank %d/%d on %s via %s, %s on %s; job id %s, results in %s", job.rank,
                 job.world_size, job.info.hostname, job.info.launcher, job.backend, job.device, job.job_id,
                 ctx.results.path)
    return ctx


def _called_job(env: dict[str, str], site_ref: str | None, name: str | None,
                timeout_s: float | None) -> tuple[str, float, Site] | None:
    """In a function ``hpcdist.Executor`` ran directly (one task, no bootstrap): the job's name,
    timeout and site, from the 0600 file it names (``HPCDIST_CALL_JOB``); what the job was
    submitted with is refused in one line naming the executor's keyword, as in a bootstrapped call."""
    from hpcdist.runtime.task_runner import call_job

    called = call_job(env)
    if called is None:
        return None
    spec, site = called
    _refuse_changed({"site": (site_ref, site.name), "name": (name, spec.name),
                     "timeout_s": (timeout_s, spec.timeout(site))})
    return spec.name, spec.timeout(site), site


def _refuse_changed(fixed: dict[str, tuple[object, object]]) -> None:
    """What an Executor function's ``init(...)`` asks against what its job was submitted with:
    one ConfigError for the first that differs, naming the executor's keyword to pass it to."""
    from hpcdist.errors import ConfigError

    for key, (asked, actual) in fixed.items():
        if asked is not None and asked != actual:
            raise ConfigError(f"hpcdist.init({key}={asked!r}) in an Executor function: the job runs with "
                              f"{key}={actual!r}, set when it was submitted; pass it there: "
                              f"hpcdist.Executor({key}={asked!r})")


def default_name(argv0: str | None = None) -> str:
    """The job name when ``init`` is given none: the script's name, or how Python was started:
    ``python-c`` (``python -c``), ``python-stdin`` (a script piped in, ``python -``),
    ``python-interactive`` (the prompt), ``notebook`` (a Jupyter kernel). A script name that is
    not a plain name has each other character replaced by ``_``."""
    argv0 = sys.argv[0] if argv0 is None and sys.argv else (argv0 or "")
    if argv0 == "-c":
        return "python-c"
    if Path(argv0).name.startswith("ipykernel_launcher") or "ipykernel" in sys.modules:
        return "notebook"
    if argv0 in ("", "-"):
        return "python-interactive" if hasattr(sys, "ps1") or sys.flags.interactive else "python-stdin"
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(argv0).stem).lstrip(".")[:128]
    return stem or "python"


def _launcher_run_id(env: dict[str, str]) -> str:
    """torchrun's run id, unless it is its default "none" (shared by every run without --rdzv-id)."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id in ("", "none") else run_id


def _new_local_id(world_size: int) -> str:
    """A job id for a run no launcher names: ``local-<UTC time>-<pid>-<random>``, rank 0's on every
    rank, so each run of a script has its own result file and a rerun never replaces the last."""
    import torch.distributed as dist

    from hpcdist.runtime.plain import broadcast_plain
    from hpcdist.store.checkpoint.directory import new_run_id

    run_id = f"local-{new_run_id()}"
    if world_size > 1 and dist.is_initialized():
        run_id = broadcast_plain(run_id, src=0, what="the run's id")
    return str(run_id)


def _release_at_exit(ctx: Context) -> None:
    """A script that never called close(): its claim must not outlive it (no collectives here),
    and a background save in flight ends first (``Context.release``)."""
    if ctx._checkpoints is not None:
        ctx.release()

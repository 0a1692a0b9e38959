"""The ``python`` job kind on the nodes: torchrun's variables set, then the user's code in-process.

hpcdist's bootstrap has done the rendezvous (finite timeouts, missing ranks named) but not made
the default process group. Here the rank gets exactly the variables torchrun's agent gives its
workers (under torchrun, torchrun's own values stand), pointing MASTER_ADDR:MASTER_PORT at the
job's TCPStore (rank 0's, or torchrun's own agent store) with ``TORCHELASTIC_USE_AGENT_STORE=True``,
so the script's ``init_process_group(backend)`` (env://) joins that store as a client
(``torch.distributed.rendezvous._create_c10d_store``) instead of opening a second one.

The code runs in this process (``runpy`` with the script's ``sys.argv``, ``SystemExit`` caught),
not in a child: torch is already imported by the bootstrap (about 4 s a rank here), the store
server and the preemption handling stay in the process submitit watches, and there is no second
process tree to forward signals to. A non-zero exit or an exception becomes one ``JobError``
naming the rank, its host and the code (or the exception), which ``submit --wait`` prints.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.contract import after_first
from hpcdist.errors import JobError
from hpcdist.kinds.python import PythonParams, cwd_on_path, wants_context
from hpcdist.runtime import group, stacks
from hpcdist.runtime.requeue import Requeued
from hpcdist.runtime.rollcall import peer_named

if TYPE_CHECKING:
    import torch

    from hpcdist.runtime.job_rank import JobRank
    from hpcdist.runtime.rankinfo import RankInfo

log = logging.getLogger("hpcdist")


def local_rank_for(info: RankInfo, device: torch.device | None) -> int:
    """The ``LOCAL_RANK`` a torchrun-style script gets: the index of the rank's own GPU among those
    its task sees, which is the node-local rank when every task sees the node's GPUs (torchrun's
    case), and not when the site binds GPUs to tasks (``--gpus-per-task=1``: ``cuda:0`` in every
    task), where ``torch.cuda.set_device(LOCAL_RANK)`` would ask for a GPU the task does not have."""
    if device is not None and device.type == "cuda" and device.index is not None:
        return device.index
    return info.local_rank


def torchrun_env(info: RankInfo, addr: str, port: int, run_id: str,
                 device: torch.device | None = None) -> dict[str, str]:
    """The variables torchrun's agent sets for a worker (plus NODE_RANK, which many scripts read,
    and HPCDIST_LOCAL_RANK, the node-local rank whatever ``LOCAL_RANK`` says of the GPU)."""
    return {
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(local_rank_for(info, device)),
        "HPCDIST_LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
        "GROUP_RANK": str(info.node_rank),
        "GROUP_WORLD_SIZE": str(info.num_nodes),
        "NODE_RANK": str(info.node_rank),
        "ROLE_RANK": str(info.rank),
        "ROLE_WORLD_SIZE": str(info.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        "TORCHELASTIC_MAX_RESTARTS": os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"),
    }


def script_env(info: RankInfo, addr: str, port: int, run_id: str, env: Mapping[str, str],
               device: torch.device | None = None) -> dict[str, str]:
    """What this rank's environment `env` gains for the script: torchrun's worker variables, with
    ``LOCAL_RANK`` the index of `device`, the rank's GPU (``local_rank_for``).

    Under torchrun itself (its agent serves the store) the worker already has them, and torchrun's
    own values stand (its ``--rdzv-id``, not hpcdist's job id): only what it leaves out is added.
    """
    wanted = torchrun_env(info, addr, port, run_id, device)
    if info.agent_store:
        return {k: v for k, v in wanted.items() if k not in env}
    return wanted


def run(ctx: JobRank, params: PythonParams) -> dict[str, Any]:
    """Run the target on this rank; returns its exit code (0) or raises a JobError naming the rank."""
    from hpcdist import api

    endpoint = ctx.endpoint
    os.environ.update(script_env(ctx.info, endpoint.addr, endpoint.port, ctx.job_id, os.environ, ctx.device))
    if ctx.device.type == "cuda":
        import torch

        torch.cuda.set_device(ctx.device)  # as torchrun's users expect: cuda:LOCAL_RANK is this rank's
        if os.environ["LOCAL_RANK"] != str(ctx.info.local_rank):
            log.info("LOCAL_RANK=%s: this rank's GPU among the %d its task sees (node-local rank %d, in "
                     "HPCDIST_LOCAL_RANK)", os.environ["LOCAL_RANK"], torch.cuda.device_count(), ctx.info.local_rank)
    api.attach(ctx)
    where = f"rank {ctx.rank} on {ctx.info.hostname}"
    watchdog = Watchdog(ctx.store, where, beat=lambda: group.beat(ctx.store, ctx.info))
    watchdog.start()
    ok = False
    try:
        with default_timeout(ctx.timeout_s):
            code, returned = _run_target(params)
        ok = code == 0
    except (Requeued, KeyboardInterrupt):
        raise
    except Exception as exc:
        stacks.on_failure(exc)  # a timeout: every rank's stack, before the watchdog stops the others
        traceback.print_exc()
        peer = peer_named(str(exc), ctx.hosts)
        error = JobError(f"{where}: {params.target} raised {type(exc).__name__}: {_first_line(exc)}"
                         + (f" ({peer})" if peer else ""))
        error = watchdog.fail(error)
        raise error from exc
    finally:
        watchdog.stop()
        api.detach(ok)
    if code != 0:
        error = watchdog.fail(JobError(f"{where}: {params.target} exited with code {code}"))
        raise error
    out: dict[str, Any] = {"host": ctx.info.hostname, "exit_code": 0}
    if returned is not None or params.call:
        out["returned"] = returned
    return out


class Watchdog(threading.Thread):
    """Stops this rank once another rank's code has failed, as torchrun's agent stops the workers.

    Without it the surviving ranks would wait in the script's own collectives (or its
    ``init_process_group``) for the dead rank until torch's 30-minute default. The failed rank
    writes one key; every rank polls it (one request per rank per interval) and, when it appears,
    prints why and exits, naming the rank that failed first. Every `beat_every` polls it also
    calls `beat` (``group.beat``): while this rank's code runs, rank 0, done with its own, keeps
    the store up for it instead of leaving after ``timeout_s``. The key is signed
    (``hpcdist.runtime.signed_store``): a failure someone else wrote there is logged and ignored,
    and cannot keep a rank's own failure from being posted.
    """

    KEY = "hpcdist/failed"

    def __init__(self, store: Any, where: str, interval_s: float = 0.5,
                 beat: Callable[[], None] | None = None, beat_every: int = 2) -> None:
        from hpcdist.runtime.signed_store import signed

        super().__init__(name="hpcdist-watchdog", daemon=True)
        self.store, self.where, self.interval_s = signed(store), where, interval_s
        self.beat, self.beat_every = beat, beat_every
        self._done = threading.Event()

    def run(self) -> None:
        from hpcdist.runtime import in_job_link

        polls = 0
        while not self._done.wait(self.interval_s):
            polls += 1
            try:
                if self.beat is not None and polls % self.beat_every == 1:
                    self.beat()
                held = self.store.peek(self.KEY)  # a forged value reads as none, and never waits
                if held is None:
                    continue
                reason = held.decode(errors="replace")
            except Exception as exc:  # rank 0, the store's server, is gone
                reason = f"the job's store (rank 0) went away ({type(exc).__name__})"
            if self._done.is_set():
                return
            if in_job_link.supervised():
                continue  # a job with spares: its supervisor ends this rank, or starts it again in place
            after = after_first(reason)
            print(f"hpcdist.errors.JobError: {self.where} stopped{' ' + after if after else ''}: {reason}",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def fail(self, error: JobError) -> JobError:
        """Tell every other rank that this one failed (first one wins; best effort). `error`, or,
        when another rank had failed first (this one's connections to it broke), `error` saying so."""
        self._done.set()
        try:
            held = self.store.compare_set(self.KEY, "", str(error)).decode(errors="replace")
        except Exception:
            return error
        after = after_first(held) if held != str(error) else ""
        return JobError(f"{error} {after}") if after else error

    def stop(self) -> None:
        self._done.set()


@contextmanager
def default_timeout(seconds: float) -> Iterator[None]:
    """The job's ``timeout_s`` as the timeout of every group the user's code makes without a
    ``timeout=`` of its own (``init_process_group``, ``new_group``, a device mesh): torch's own
    default is 30 minutes (10 for NCCL), so a hang would burn the allocation and never reach the
    timeout's stacks and summary. An explicit ``timeout=`` wins. torch asks one private function
    for that default; where a torch lacks it, its default stands (said in the rank's log)."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    saved = getattr(c10d, "_get_default_timeout", None)
    if saved is None:
        log.warning("this torch has no distributed_c10d._get_default_timeout: groups the code makes without "
                    "timeout= keep torch's default, not the job's timeout_s=%g", seconds)
        yield
        return
    c10d._get_default_timeout = lambda backend: timedelta(seconds=seconds)
    try:
        yield
    finally:
        c10d._get_default_timeout = saved


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _run_target(params: PythonParams) -> tuple[int, Any]:
    """(exit code, the function's return value) of the target run in this process."""
    returned = None
    try:
        with _argv_and_path(params):
            if params.script:
                runpy.run_path(params.script, run_name="__main__")
            elif params.module:
                runpy.run_module(params.module, run_name="__main__", alter_sys=True)
            elif params.call:
                returned = _call(params)
            else:
                returned = _function(params)(*params.args)
    except Requeued:
        raise
    except SystemExit as exc:
        return _exit_code(exc), None
    return 0, returned


def _exit_code(exc: SystemExit) -> int:
    """What the shell would see for ``sys.exit(code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _function(params: PythonParams) -> Callable[..., Any]:
    import importlib

    module, _, name = str(params.function).partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def _call(params: PythonParams) -> Any:
    """An ``hpcdist.Executor`` call: the pickled function run with its arguments after
    ``hpcdist.init()`` (the group made), the rank's ``Context`` first when the function's first
    parameter is annotated so; its return value, which must pickle to travel back."""
    import cloudpickle

    from hpcdist.api.launch import for_call
    from hpcdist.files.trust import load_pickle

    fn, args, kwargs = load_pickle(str(params.call))  # read from what was checked: no one else's call runs
    ctx = for_call()
    if hasattr(fn, "__submitit_checkpoint__") or hasattr(fn, "checkpoint"):  # submitit's Checkpointable
        _checkpoint_on_stop(ctx, fn, args, kwargs, str(params.call))
    if wants_context(fn):
        args = (ctx, *args)
    value = fn(*args, **kwargs)
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        raise JobError(f"its return value, a {type(value).__module__}.{type(value).__qualname__}, cannot be "
                       f"pickled to travel back ({type(exc).__name__}: {_first_line(exc)}); return plain data "
                       f"(numbers, strings, lists, dicts, tensors, arrays)") from exc
    return value


def _checkpoint_on_stop(ctx: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], call: str) -> None:
    """submitit's Checkpointable in a job of several tasks, as submitit's own handler does it:
    on the site's preemption signal (a time limit or a preemption) rank 0 calls the callable's
    ``__submitit_checkpoint__`` (else ``checkpoint``) with its arguments, the DelayedSubmission
    it returns becomes the job's call (the 0600 pickle, replaced atomically), and the job is
    requeued; the other ranks go on until the requeue ends them. Time-outs are bounded by
    ``preemption.max_requeues``."""
    import signal

    from hpcdist.runtime import requeue as rq

    def on_stop(signum: int, frame: Any) -> None:
        rq._on_signal(signum, frame)  # ctx.should_stop() still sees it
        if ctx.rank != 0:
            return
        if ctx._requeue is None:
            raise JobError("a Checkpointable was stopped, but this launch was not started by submitit or Slurm: "
                           "not requeued; resubmit it to resume from its checkpoint")
        ctx.stop_kind = ctx._classify()
        refusal = ctx.requeue_refusal()  # the site's bound on time-outs, as Context.requeue applies it
        if refusal:
            raise JobError(refusal)
        checkpoint = getattr(fn, "__submitit_checkpoint__", None) or fn.checkpoint  # submitit's order
        delayed = checkpoint(*args, **kwargs)
        if delayed is None:
            raise JobError(f"{type(fn).__qualname__}.__submitit_checkpoint__ returned None: not requeued")
        _replace_call(call, (delayed.function, delayed.args, delayed.kwargs))
        log.warning("rank 0: %s checkpointed on SIG%s (%s); requeueing", type(fn).__qualname__,
                    rq.signal_name(signum), ctx.stop_kind)
        ctx.leave_for_requeue()

    signal.signal(getattr(signal, f"SIG{ctx.job.site.preemption.signal}"), on_stop)
    if rq.received():  # the signal came during the bootstrap
        on_stop(rq.received(), None)


def _replace_call(call: str, new: tuple[Any, ...]) -> None:
    """The job's call pickle replaced by `new`, atomically and still the user's alone (0600)."""
    import cloudpickle

    from hpcdist.files.atomic import atomic_path

    with atomic_path(Path(call)) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            cloudpickle.dump(new, f)


@contextmanager
def _argv_and_path(params: PythonParams) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` (or ``-m``) would have them."""
    if params.code_dir:
        from hpcdist.files.trust import trusted_tree

        trusted_tree(params.code_dir)
    saved_argv = sys.argv[:]
    first = params.script or params.module or params.call_name or str(params.function)
    sys.argv = [first, *params.args]
    extra = str(Path(params.script).parent) if params.script else params.code_dir
    try:
        with cwd_on_path(params.code_dir), cwd_on_path(extra):
            yield
    finally:
        sys.argv = saved_argv

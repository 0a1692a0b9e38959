"""``Context``: one rank's facts and handles, what ``hpcdist.init()`` returns.

Rank facts, device, process group, a logger with rank prefixes, ``results`` (written by rank 0
on ``close``), ``checkpoints`` (claimed on first use), and preemption: ``should_stop()`` and
``requeue()``, with the job's requeue count and its bound (``hpcdist.runtime.requeue``): the
count is saved in every checkpoint, restored with it, and never below Slurm's own count.
torch is imported where it is used, never at import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from hpcdist.api.checkpoints import CheckpointManager
from hpcdist.config.contract import LAUNCH_TIME_VAR, RERUN_VAR
from hpcdist.errors import JobError
from hpcdist.runtime import requeue as rq

if TYPE_CHECKING:

    from hpcdist.runtime.job_rank import JobRank
    from hpcdist.runtime.rankinfo import RankInfo


CURRENT: list[Context] = []  # what ``hpcdist.init()`` returned on this rank, so a second call returns the same


def _node_failure_runs(job: JobRank) -> int:
    """How many of the job's runs ended by a node death (its node failure record, beside the result)."""
    from hpcdist.store.records import node_failures

    return len({f.run for f in node_failures.read(job.paths.node_failures)})


def forget(ctx: Context) -> None:
    """`ctx` is closed: a later ``init`` makes a new one."""
    if CURRENT and CURRENT[0] is ctx:
        CURRENT.clear()


@dataclass
class Results:
    """Attributes and tables for the job's HDF5 result file, written by rank 0 on ``close``.

    A table name may hold a ``/`` (``train/steps``): the table goes in that group."""

    path: Path
    attrs: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def table(self, name: str, columns: Mapping[str, Any]) -> None:
        """A table of equal-length columns (replaces one of the same name)."""
        self.tables[name] = columns


class Context:
    """One rank's handles: facts, device, group, logger, results, checkpoints, preemption."""

    def __init__(self, job: JobRank, *, checkpoint_dir: str | Path | None = None, keep_last: int | None = 3,
                 own_group: bool = False, log: logging.Logger | None = None, io_timeout_s: float | None = None):
        """The handles on `job`, the rank's one context from the bootstrap (``hpcdist.runtime.bootstrap``):
        its facts are read from there, never copied. `own_group`: ``close`` leaves the default
        group (and, outside a job, finishes the store); `log`: a built-in kind's logger."""
        self.job = job
        spec, site = job.spec, job.site
        self.info, self.device, self.backend, self.timeout_s = job.info, job.device, job.backend, job.timeout_s
        self.name, self.job_id, self.kind, self.site_name = spec.name, job.job_id, spec.kind, site.name
        self.hosts = job.hosts or (job.info.hostname,)
        self.log = log or _logger(job.info)
        self.results = Results(job.paths.result())
        self._checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else job.checkpoint_dir
        self._keep_last = keep_last
        self.io_timeout_s = io_timeout_s  # how long ranks wait for rank 0's checkpoint I/O (None: the default)
        self._checkpoints: CheckpointManager | None = None
        self._requeue, self._own_group = job.requeue, own_group
        self._closed = False
        self._tracking: Any = None  # the job's tracker run (hpcdist.track), opened by the first track() on rank 0
        # files made from the written result at close (a built-in job's plots), each sent as an artifact
        self.result_artifacts: list[Callable[[Path], list[Path]]] = []
        self.implicit = False  # made by the runner for an Executor function: its first own init(...) sets its arguments
        # The requeue count: Slurm's own count as a floor, the checkpoint's when one is restored.
        self.restarts, self.max_requeues = rq.restart_count(os.environ), site.preemption.max_requeues
        self.node_failure_restarts = _node_failure_runs(job) if self.restarts else 0
        self.requeue_count = rq.Requeues().at_least(self.restarts, self.node_failure_restarts)
        # on_rank_failure: in_place: how often this process ran the job before (its module globals, threads and
        # CUDA memory are as the failed run left them; torch.compile's caches were reset)
        self.reruns = int(os.environ.get(RERUN_VAR, "0") or 0)
        self.stop_kind: rq.StopKind | None = None  # once should_stop() said True: time-out or preemption
        self.stop_signal = ""  # the signal that stopped the job (TERM, USR2), once should_stop() said True
        for name_ in rq.watch((site.preemption.signal, "TERM")):
            self.log.warning("cannot handle SIG%s outside the main thread; should_stop() will not see it", name_)

    def _classify(self) -> rq.StopKind:
        """A stop now: a time-out if it came within the warning time of the job's time limit (a
        preemption outside a job, whose time limit hpcdist does not know)."""
        if self.job.standalone:
            return "preemption"
        launch = float(os.environ.get(LAUNCH_TIME_VAR, "nan"))
        now = time.time()
        site = self.job.site
        return rq.classify(now, now if launch != launch else launch, self.job.spec.time_limit_min(site) * 60.0,
                           site.preemption.seconds_before_end)

    rank = property(lambda self: self.info.rank)
    world_size = property(lambda self: self.info.world_size)
    local_rank = property(lambda self: self.info.local_rank)
    is_main = property(lambda self: self.info.rank == 0)

    @property
    def group(self) -> Any:
        """The default process group (torch.distributed's WORLD)."""
        import torch.distributed as dist

        return dist.group.WORLD

    @property
    def checkpoints(self) -> CheckpointManager:
        """The job's checkpoint directory, claimed by rank 0 on first use (a collective)."""
        if self._checkpoints is None:
            self._checkpoints = CheckpointManager(self, self._checkpoint_dir, self._keep_last)
        return self._checkpoints

    def track(self, step: int, **metrics: float) -> None:
        """Log `metrics` (numbers) at `step` to every tracker the job names (``tracking:``): rank 0's
        values, other ranks' calls do nothing. Sent by a background thread: a tracker that is down
        costs a warning a minute. After a restart, log from the step the checkpoint resumed at."""
        run = self.tracking_run()
        if run is not None:
            run.metrics(step, metrics)

    def tracking_run(self) -> Any:
        """The job's ``hpcdist.track.Run`` on rank 0 (None elsewhere, or when the job names no tracker)."""
        if self._tracking is None and self.is_main and not self._closed:
            from hpcdist.track import open_run

            self._tracking = open_run(self.job.spec, self.job.site, self.job_id, self.rank) or False
        return self._tracking or None

    def _end_tracking(self, finished: bool) -> None:
        if self._tracking:  # a requeue waits less: Slurm's kill may follow soon
            self._tracking.close(finished, timeout_s=20.0 if finished else 10.0)
        self._tracking = False

    def should_stop(self) -> bool:
        """True on every rank once any rank received the preemption signal or SIGTERM (a
        collective: call it on every rank at the same step). The first time, rank 0 tells a
        time-out from a preemption (``stop_kind``), which checkpoints then count."""
        import torch
        import torch.distributed as dist

        if self.stop_kind is not None:
            return True
        flag = torch.tensor([float(rq.received())], device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return False
        self.stop_signal = rq.signal_name(int(flag.item()))
        kind = self._classify() if self.is_main else None
        self.stop_kind = self.broadcast(kind)
        return True

    def ignore_stop(self) -> None:
        """The caller finishes instead of stopping (its last step): the stop is not counted."""
        self.stop_kind = None

    def counts_if_requeued(self) -> rq.Requeues:
        """The requeue count once this stop requeues: what a checkpoint written now records."""
        return self.requeue_count.after(self.stop_kind) if self.stop_kind else self.requeue_count

    def restore_requeues(self, counts: rq.Requeues, job_id: str) -> None:
        """The count a checkpoint recorded, if this job wrote it (a requeue); a resubmission,
        another job, starts its own count. Never below Slurm's."""
        if job_id == self.job_id:
            self.requeue_count = counts.at_least(self.restarts, self.node_failure_restarts)

    def requeue_refusal(self, committed: Path | str | None = None) -> str:
        """Why this stop must not requeue ("" if it may): more time-outs than the site allows."""
        counts = self.counts_if_requeued()
        if self.max_requeues is None or not counts.over(self.max_requeues):
            return ""
        kept = f"; the last checkpoint is committed in {committed}" if committed else ""
        return (f"job timed out {counts.timeouts} time(s), more than preemption.max_requeues={self.max_requeues}: "
                f"not requeued{kept}: resubmit the same spec to continue, or raise resources.time_min")

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank: plain data (``hpcdist.runtime.plain``: None, bool, int,
        float, str, bytes, lists, tuples, dicts, numpy arrays, tensors, which come back on the CPU),
        sent as JSON, never as a pickle; anything else is one DataError on every rank."""
        import torch.distributed as dist

        from hpcdist.runtime.plain import broadcast_plain

        if not dist.is_initialized() or self.world_size == 1:
            return value
        return broadcast_plain(value, src=0)

    @property
    def can_requeue(self) -> bool:
        """Whether ``requeue`` can requeue this launch (submitit or Slurm started it)."""
        return self._requeue is not None

    def requeue(self) -> None:
        """Requeue the job (after the caller's checkpoint) and leave: every rank calls it.

        A background save in flight is waited for first (a collective), so the stop-time
        checkpoint is committed before Slurm can kill the job; if it failed, its CheckpointError is
        raised on every rank (results written as incomplete) and the job is not requeued.
        Refused (a JobError on every rank, results written as incomplete) past the site's
        ``preemption.max_requeues`` time-outs. Where Slurm requeues the job itself (it preempted
        it) or ends it (``scancel``), rank 0 says so and every rank leaves without requeueing."""
        import torch.distributed as dist

        from hpcdist.errors import CheckpointError

        if self._checkpoints is not None:
            try:
                self._checkpoints.wait()
            except CheckpointError:
                self._write_results(complete=False)
                raise
        if self._requeue is None:
            raise JobError(f"{self.name}: asked to requeue, but this launch was not started by submitit or Slurm; "
                           f"resubmit the same command to resume from the last checkpoint")
        refusal = self.requeue_refusal()
        if refusal:
            self._write_results(complete=False)
            raise JobError(refusal)
        self.requeue_count, self.stop_kind = self.counts_if_requeued(), None
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()  # the checkpoint is committed and every rank knows it
        self.log.warning("rank %d leaves for the requeue", self.rank)
        self._write_results(complete=False)
        self._end_tracking(finished=False)
        self._closed = True  # the claim stays: the requeued job (same id) takes it back
        self.leave_for_requeue()

    def leave_for_requeue(self) -> NoReturn:
        """Rank 0 asks for the requeue (or says why Slurm requeues or ends the job itself); this
        rank leaves without a result. ``requeue`` after its checkpoint, and a submitit
        Checkpointable's handler (``hpcdist.kinds.python_run``) after the callable's own."""
        if self.is_main and self._requeue is not None:
            try:
                why = self._requeue()
            except SystemExit as exc:  # the local executor requeues by exit code 144
                raise rq.Requeued(exc.code) from None
            if why:
                self.log.warning("%s", why)
        raise rq.Requeued(1)

    def close(self) -> None:
        """Wait for a background save, write the results (rank 0), release the checkpoint claim,
        leave the group hpcdist made."""
        if self._closed:
            return
        self._closed = True
        if self._checkpoints is not None:
            self._checkpoints.wait()
        self._write_results(complete=True)
        if self._tracking and self.results.path.exists():
            self._tracking.artifact(self.results.path)
            for make in self.result_artifacts:
                try:
                    made = make(self.results.path)
                except Exception as exc:  # a plot that fails costs the trackers that file, not the job
                    self.log.warning("tracking: no %s for the trackers: %s: %s", getattr(make, "__name__", "file"),
                                     type(exc).__name__, exc)
                    continue
                for path in made:
                    self._tracking.artifact(path)
        self._end_tracking(finished=True)
        if self._checkpoints is not None:
            self._checkpoints.release()
        import torch.distributed as dist

        if self._own_group and dist.is_initialized():
            if self.job.standalone and self.job.store is not None:  # a job's store is finished by the job
                from hpcdist.runtime import group

                if group.finish(self.job.store, self.info, self.timeout_s):
                    dist.destroy_process_group()  # a rank is gone: no last barrier
            from hpcdist.runtime import teardown

            teardown.leave()  # every gloo worker idle before the interpreter finalizes (SIGABRT otherwise)
        forget(self)

    def release(self) -> None:
        """After a failure: drop the checkpoint claim, no collectives, no results written. A
        background save in flight is waited for first (on rank 0), so the claim is never dropped
        while a write goes on; its error, if it failed, is logged."""
        self._closed = True
        self._end_tracking(finished=False)
        if self._checkpoints is None:
            return
        try:
            stats = self._checkpoints.store.wait()
        except Exception as exc:  # a failure is being handled already: say so, do not mask it
            self.log.error("the background checkpoint save in %s failed: %s", self._checkpoints.directory, exc)
        else:
            if stats is not None:
                self.log.info("checkpoint %s committed (the background save was waited for)", stats.path)
        self._checkpoints.release()

    def _write_results(self, complete: bool) -> None:
        if not self.is_main or not (self.results.attrs or self.results.tables):
            return
        from hpcdist.store.results import result_file, run_attrs, write_table

        job = self.job
        attrs = run_attrs(kind=self.kind, job_name=self.name, job_id=self.job_id, site=self.site_name,
                          hosts=list(self.hosts), num_nodes=self.info.num_nodes,
                          spec_json="{}" if job.standalone else job.spec.model_dump_json(),
                          site_json=job.site.model_dump_json())
        attrs.update(world_size=self.world_size, complete=complete)
        attrs.update(self.results.attrs)  # the caller's own figures win, `complete` included
        self.results.path.parent.mkdir(parents=True, exist_ok=True)
        with result_file(self.results.path, attrs) as f:
            for name, columns in self.results.tables.items():
                write_table(f, name, columns)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _logger(info: RankInfo) -> logging.Logger:
    """``hpcdist.user``: records prefixed with the rank and host, to stderr (kept when set up already)."""
    from hpcdist.runtime.ranklog import rank_logger

    return rank_logger("hpcdist.user", info, os.environ, replace=False)

"""The public API for the user's own code: ``ctx = hpcdist.init()``.

    import hpcdist
    ctx = hpcdist.init()                      # rank facts, device, process group, logger
    latest = ctx.checkpoints.load_latest()    # (step, state) or None; state as it was saved
    ...
    ctx.checkpoints.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
    if ctx.should_stop():                     # the site's preemption signal or SIGTERM, on any rank
        ctx.checkpoints.save(step, state); ctx.requeue()
    ctx.results.attrs["final_loss"] = loss; ctx.close()

It works under every launcher hpcdist knows, inside an hpcdist job or not: in a ``python`` job
it builds on that rank's bootstrap (``attach``); under plain torchrun, srun, mpirun or a single
process it does hpcdist's own rendezvous (finite timeouts, missing ranks named) unless the
default group already exists. Checkpoints are the model-agnostic ``CheckpointStore`` with the
directory claimed by rank 0 for the context's lifetime; rank 0 writes, every rank loads the one
step rank 0 resolved. ``import hpcdist`` stays light: torch is imported by ``init``.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.errors import CheckpointError, JobError

if TYPE_CHECKING:
    import torch

    from hpcdist.config.site import Site
    from hpcdist.runtime.context import JobContext
    from hpcdist.runtime.rankinfo import RankInfo
    from hpcdist.store.claim import Claim
    from hpcdist.store.manager import CheckpointStore

_ACTIVE: list[JobContext] = []  # the python job's bootstrap on this rank, when there is one
_CONTEXT: list[Context] = []  # what init() returned, so a second call returns the same
DEFAULT_TIMEOUT_S = 120.0
_NONE = "__none__"
_INT = "__int__"
_SEQ = "__seq__"


def attach(ctx: JobContext) -> None:
    """Make `ctx` (a ``python`` job's bootstrap on this rank) what ``init`` builds on."""
    _ACTIVE[:] = [ctx]


def detach(ok: bool) -> None:
    """End of the python job's code on this rank: close a context it left open (write its
    results) when the code succeeded; after a failure or a requeue only release the claim."""
    if _CONTEXT:
        if ok:
            _CONTEXT[0].close()
        else:
            _release_at_exit(_CONTEXT[0])
            _CONTEXT.clear()
    _ACTIVE.clear()


@dataclass
class Results:
    """Attributes and tables for the job's HDF5 result file, written by rank 0 on ``close``."""

    path: Path
    attrs: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def table(self, name: str, columns: Mapping[str, Any]) -> None:
        """A table of equal-length columns (replaces one of the same name)."""
        self.tables[name] = columns


class Checkpoints:
    """The job's ``CheckpointStore`` as every rank uses it: rank 0 claims and writes, all load."""

    def __init__(self, ctx: Context, directory: Path, keep_last: int | None) -> None:
        from hpcdist.store.manager import CheckpointStore

        self.ctx = ctx
        self.store: CheckpointStore = CheckpointStore(directory, keep_last=keep_last)
        self.claim: Claim | None = None
        error = ""
        if ctx.is_main:
            try:
                self.claim = self.store.claim()
                if self.claim.took_over is not None:
                    ctx.log.warning("took over the stale claim of %s on %s", self.claim.took_over.describe(), directory)
            except CheckpointError as exc:
                error = str(exc)
        error = ctx.broadcast(error)
        if error:
            raise CheckpointError(error)

    @property
    def directory(self) -> Path:
        return self.store.directory

    def save(self, step: int, state: Mapping[str, Any], *, attrs: Mapping[str, Any] | None = None) -> Path:
        """Commit `state` (a nested dict of tensors, arrays and plain values) as `step` on rank 0;
        every rank returns once it is committed, or raises the same error."""
        error = ""
        if self.ctx.is_main:
            try:
                self.store.save(step, {"state": encode(state)}, attrs=attrs)
            except Exception as exc:
                error = f"saving step {step} in {self.directory} failed: {type(exc).__name__}: {exc}"
        error = self.ctx.broadcast(error)
        if error:
            raise CheckpointError(error)
        return self.store.path(step)

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest committed checkpoint that verifies, or None: rank 0 picks
        the step, every rank loads that one (never a newer one a concurrent writer commits)."""
        latest = self.store.load_latest(self.ctx.log.warning) if self.ctx.is_main else None
        step = self.ctx.broadcast(latest.step if latest is not None else None)
        if step is None:
            return None
        return step, decode((latest or self.store.load(step)).tree["state"])

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()
            self.claim = None


class Context:
    """One rank's handles: facts, device, group, logger, results, checkpoints, preemption."""

    def __init__(self, *, info: RankInfo, device: torch.device, backend: str, timeout_s: float, name: str,
                 job_id: str, checkpoint_dir: Path, result_path: Path, keep_last: int | None,
                 requeue: Callable[[], None] | None, own_group: bool, store: Any, stop_signals: tuple[str, ...],
                 site_name: str = "", spec_json: str = "{}", site_json: str = "{}"):
        self.site_name, self._spec_json, self._site_json = site_name, spec_json, site_json
        self.info, self.device, self.backend, self.timeout_s = info, device, backend, timeout_s
        self.name, self.job_id = name, job_id
        self.log = _logger(info)
        self.results = Results(result_path)
        self._checkpoint_dir, self._keep_last = checkpoint_dir, keep_last
        self._checkpoints: Checkpoints | None = None
        self._requeue, self._own_group, self._store = requeue, own_group, store
        self._stop_received = False
        self._closed = False
        for name_ in stop_signals:
            try:
                signal.signal(getattr(signal, f"SIG{name_}"), self._on_signal)
            except ValueError:  # not the main thread: the launcher's default stays
                self.log.warning("cannot handle SIG%s outside the main thread; should_stop() will not see it", name_)

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
    def checkpoints(self) -> Checkpoints:
        """The job's checkpoint directory, claimed by rank 0 on first use (a collective)."""
        if self._checkpoints is None:
            self._checkpoints = Checkpoints(self, self._checkpoint_dir, self._keep_last)
        return self._checkpoints

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_received = True  # only a flag: the ranks agree at a step boundary

    def should_stop(self) -> bool:
        """True on every rank once any rank received the preemption signal or SIGTERM (a
        collective: call it on every rank at the same step)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self._stop_received else 0.0], device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (picklable objects)."""
        import torch.distributed as dist

        if not dist.is_initialized() or self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def requeue(self) -> None:
        """Requeue the job (after the caller's checkpoint) and leave: every rank calls it."""
        import torch.distributed as dist

        from hpcdist.runtime.requeue import Requeued

        if self._requeue is None:
            raise JobError(f"{self.name}: asked to requeue, but this launch was not started by submitit or Slurm; "
                           f"resubmit the same command to resume from the last checkpoint")
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()  # the checkpoint is committed and every rank knows it
        self.log.warning("rank %d leaves for the requeue", self.rank)
        self._write_results(complete=False)
        self._closed = True  # the claim stays: the requeued job (same id) takes it back
        if self.is_main:
            try:
                self._requeue()
            except SystemExit as exc:  # the local executor requeues by exit code 144
                raise Requeued(exc.code) from None
        raise Requeued(1)

    def close(self) -> None:
        """Write the results (rank 0), release the checkpoint claim, leave the group hpcdist made."""
        if self._closed:
            return
        self._closed = True
        self._write_results(complete=True)
        if self._checkpoints is not None:
            self._checkpoints.release()
        import torch.distributed as dist

        if self._own_group and dist.is_initialized():
            if self._store is not None:
                from hpcdist.runtime import group

                group.finish(self._store, self.info, self.timeout_s)
            dist.destroy_process_group()
        _CONTEXT.clear()

    def _write_results(self, complete: bool) -> None:
        if not self.is_main or not (self.results.attrs or self.results.tables):
            return
        from hpcdist.store.results import result_file, run_attrs, write_table

        attrs = run_attrs(kind="python", job_name=self.name, job_id=self.job_id, site=self.site_name,
                          hosts=[self.info.hostname], num_nodes=self.info.num_nodes,
                          spec_json=self._spec_json, site_json=self._site_json)
        attrs.update(world_size=self.world_size, complete=complete, **self.results.attrs)
        self.results.path.parent.mkdir(parents=True, exist_ok=True)
        with result_file(self.results.path, attrs) as f:
            for name, columns in self.results.tables.items():
                write_table(f, name, columns)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(*, site: str | None = None, name: str | None = None, timeout_s: float | None = None,
         checkpoint_dir: str | Path | None = None, keep_last: int | None = 3) -> Context:
    """This rank's Context, made once per process (later calls return the same one).

    `site` (or $HPCDIST_SITE) names the site whose storage and preemption signal to use outside
    an hpcdist job; `name` defaults to the script's name; `checkpoint_dir` overrides the job's
    ``<checkpoints>/<name>``.
    """
    if _CONTEXT:
        return _CONTEXT[0]
    ctx = _from_job(_ACTIVE[0], checkpoint_dir, keep_last) if _ACTIVE else _standalone(
        site, name, timeout_s, checkpoint_dir, keep_last)
    _CONTEXT.append(ctx)
    return ctx


def _from_job(job: JobContext, checkpoint_dir: str | Path | None, keep_last: int | None) -> Context:
    """In a python job: the bootstrap's store and facts; the group made on its store."""
    import torch.distributed as dist

    from hpcdist.runtime import group

    own = not dist.is_initialized()
    if own:
        group.init_process_group(job.store, job.info, job.backend, job.timeout_s)
    return Context(
        info=job.info, device=job.device, backend=job.backend, timeout_s=job.timeout_s, name=job.spec.name,
        job_id=job.job_id, checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else job.checkpoint_dir,
        result_path=job.result_path(), keep_last=keep_last, requeue=job.requeue, own_group=own, store=None,
        stop_signals=(job.site.preemption.signal, "TERM"), site_name=job.site.name,
        spec_json=job.spec.model_dump_json(), site_json=job.site.model_dump_json(),
    )


def _standalone(site_ref: str | None, name: str | None, timeout_s: float | None,
                checkpoint_dir: str | Path | None, keep_last: int | None) -> Context:
    """Outside an hpcdist job: rank facts from the launcher, hpcdist's rendezvous unless env://
    already made the group."""
    import torch
    import torch.distributed as dist

    from hpcdist.runtime import group
    from hpcdist.runtime.rankinfo import RankInfo
    from hpcdist.runtime.requeue import submitit_requeue

    env = dict(os.environ)
    info = RankInfo.from_env(env)
    site = _site(site_ref or env.get("HPCDIST_SITE"))
    timeout = timeout_s or (site.defaults.timeout_s if site else DEFAULT_TIMEOUT_S)
    name = name or Path(sys.argv[0]).stem or "python"
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", info.local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    store, own = None, not dist.is_initialized()
    if own:
        if cuda:
            torch.cuda.set_device(device)
        if info.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            store, _ = group.open_store(
                info, timeout, key=group.rendezvous_key(env, info),
                rendezvous_dir=site.storage.scratch / "rendezvous" if site else None,
                ifname=site.network.socket_ifname if site else None,
            )
            group.check_in(store, info, timeout)
            group.init_process_group(store, info, backend, timeout)
    job_id = info.job_id or env.get("TORCHELASTIC_RUN_ID") or "local"
    storage = site.storage if site else None
    ckpt = Path(checkpoint_dir) if checkpoint_dir else (
        storage.checkpoints if storage else Path("hpcdist-out/checkpoints")) / name
    results = (storage.results if storage else Path("hpcdist-out/results")) / name / f"{job_id}.h5"
    requeue = submitit_requeue(None, env) or _slurm_requeue(env)
    signals = (site.preemption.signal if site else env.get("SUBMITIT_PREEMPTION_SIGNAL", "USR2"), "TERM")
    ctx = Context(info=info, device=device, backend=backend, timeout_s=timeout, name=name, job_id=job_id,
                  checkpoint_dir=ckpt, result_path=results, keep_last=keep_last, requeue=requeue, own_group=own,
                  store=store, stop_signals=signals, site_name=site.name if site else "",
                  site_json=site.model_dump_json() if site else "{}")
    atexit.register(_release_at_exit, ctx)
    ctx.log.info("hpcdist.init: rank %d/%d on %s via %s, %s on %s", info.rank, info.world_size, info.hostname,
                 info.launcher, backend, device)
    return ctx


def _release_at_exit(ctx: Context) -> None:
    """A script that never called close(): its claim must not outlive it (no collectives here)."""
    if ctx._checkpoints is not None:
        ctx._checkpoints.release()


def _site(ref: str | None) -> Site | None:
    if not ref:
        return None
    from hpcdist.config import load_site

    return load_site(ref)


def _slurm_requeue(env: Mapping[str, str]) -> Callable[[], None] | None:
    """`scontrol requeue` for a Slurm job not started through submitit."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None

    def requeue() -> None:
        import subprocess

        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)

    return requeue


def _logger(info: RankInfo) -> logging.Logger:
    """``hpcdist.user``: records prefixed with the rank and host, to stderr."""
    log = logging.getLogger("hpcdist.user")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        host = info.hostname or socket.gethostname()
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s [rank {info.rank}/{info.world_size} {host}] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(os.environ.get("HPCDIST_LOG_LEVEL", "INFO"))
        log.propagate = False
    return log


# ---------------------------------------------------------------- any state <-> a checkpoint tree


def encode(value: Any) -> Any:
    """A state (state_dicts, RNG states, nested lists, None, int keys) as a store tree: what HDF5
    cannot name or hold is spelled with markers that ``decode`` reverses."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CheckpointError(f"state key {key!r} is a {type(key).__name__}; use str or int keys")
            text = f"{_INT}{key}" if isinstance(key, int) else key
            if "/" in text or text in ("", ".", _SEQ):
                raise CheckpointError(f"state key {key!r} cannot name an HDF5 member; rename it")
            out[text] = encode(item)
        return out
    if isinstance(value, tuple) or (isinstance(value, list) and not _plain_list(value)):
        return {_SEQ: "tuple" if isinstance(value, tuple) else "list",
                **{str(i): encode(v) for i, v in enumerate(value)}}
    if value is None:
        return _NONE
    return value


def _plain_list(items: list[Any]) -> bool:
    """A list HDF5 keeps as one attribute: all str, or all numbers of one kind."""
    kinds = {bool if isinstance(v, bool) else int if isinstance(v, int) else float if isinstance(v, float)
             else str if isinstance(v, str) else None for v in items}
    return len(kinds) <= 1 and None not in kinds


def decode(value: Any) -> Any:
    """The state ``encode`` wrote, arrays as torch tensors (on the CPU)."""
    if isinstance(value, dict):
        if _SEQ in value:
            items = [decode(value[str(i)]) for i in range(len(value) - 1)]
            return tuple(items) if value[_SEQ] == "tuple" else items
        return {int(k[len(_INT):]) if k.startswith(_INT) else k: decode(v) for k, v in value.items()}
    if hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, (int, float)):
        import torch

        return torch.from_numpy(value)
    if isinstance(value, str) and value == _NONE:
        return None
    return value

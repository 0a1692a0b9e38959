"""The public API for the user's own code (node side: it runs in every rank): ``ctx = hpcdist.init()``.

    import hpcdist
    ctx = hpcdist.init()                      # rank facts, device, process group, logger
    latest = ctx.checkpoints.load_latest()    # (step, state) or None; state as it was saved
    ...
    ctx.checkpoints.save(step, {"model": model.state_dict(), "opt": opt.state_dict()}, background=True)
    if ctx.should_stop():                     # the site's preemption signal or SIGTERM, on any rank
        ctx.checkpoints.save(step, state); ctx.requeue()
    ctx.results.attrs["final_loss"] = loss; ctx.close()

It works under every launcher hpcdist knows, inside an hpcdist job or not: the context is the
handles on the one context hpcdist's bootstrap returns on the rank (in a ``python`` job, the
job's; under plain torchrun, srun, mpirun or a single process, the same bootstrap run by
``init``: finite timeouts, missing ranks named, a default group that already exists used as it is).
Checkpoints are the model-agnostic ``CheckpointStore`` with the
directory claimed by rank 0 for the context's lifetime; rank 0 writes, every rank loads the one
step rank 0 resolved. ``train_gpt`` is built on this API. ``import hpcdist`` stays light: torch is imported by ``init``.

The package: ``launch`` (``init``, and the runtime's ``attach``/``detach``), ``context``
(``Context``, ``Results``), ``checkpoints`` (``Checkpoints``), ``codec`` (any state <-> a store tree).
"""

from hpcdist.api.checkpoints import Checkpoints
from hpcdist.api.codec import decode, encode
from hpcdist.api.context import Context, Results
from hpcdist.api.launch import attach, detach, init

__all__ = ["Checkpoints", "Context", "Results", "attach", "decode", "detach", "encode", "init"]

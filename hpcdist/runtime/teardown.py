"""Leaving torch.distributed with no collective's work still being freed.

A gloo worker thread drops a finished collective's Work (and the tensors it holds, which Python
owns) just after the waiting thread wakes. When the interpreter is already finalizing by then,
that thread takes the GIL inside a destructor and ``std::terminate`` aborts the rank: SIGABRT
at exit, about 1 run in 20 of FSDP on CPU here (a core showed ``~AsyncAllgatherCoalescedWork``
in ``ProcessGroupGloo::runLoop`` while the main thread was in ``Py_FinalizeEx``). FSDP makes it
likely: its all-gathers and reduce-scatters run on the mesh's groups until the last step, and its
modules keep those groups alive in reference cycles, past ``destroy_process_group``.

`leave` makes every worker idle first: a barrier on each group this rank belongs to (gloo runs a
barrier after every earlier work of its group, and the barrier's own work holds no tensor),
then a garbage collection that frees the cycles, then ``destroy_process_group``.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("hpcdist")


def leave() -> None:
    """Barrier on every process group of this rank, in creation order (the same on every rank,
    so no two ranks wait on each other's groups crosswise), collect, destroy. A barrier that
    fails (a rank already gone after an error) is logged: the rank leaves anyway."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    try:
        for group in list(_world.pg_map):
            dist.barrier(group=group)
    except Exception as exc:  # noqa: BLE001 - leaving: the error that matters was raised before
        log.warning("leaving torch.distributed: a last barrier failed (%s: %s); destroying the groups anyway",
                    type(exc).__name__, str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "")
    gc.collect()
    dist.destroy_process_group()
    gc.collect()  # what only the groups' destruction released


def drop(failure: BaseException | None = None) -> None:
    """After this rank's job failed (`failure`) under an in-job supervisor that may start it again
    in place: its process groups closed at once, no barrier. Closing gloo's sockets is what makes a
    survivor that still waits on this rank in a collective fail now rather than at its timeout
    (gloo's ``abort()`` does not close them: measured here, a peer waiting on a rank that had
    called it stayed in its all-reduce until that rank's process ended; after
    ``destroy_process_group`` it raised within a second). That holds only where nothing else
    refers to the group: gloo closes a group's sockets when its last reference goes, and a
    failure's traceback frames keep one until they are cleared, so the finished frames of
    `failure`'s tracebacks (and of its causes) lose their locals first (the traceback's text, all
    a report shows, stays), and a collection follows the close. Measured with train_gpt, rank 2
    killed: a survivor stuck in a broadcast from rank 0, which had failed, in 3 of 5 runs before;
    see docs/performance.md. NCCL's communicators are aborted
    instead, which does not wait for their kernels. A failure to close is logged: the rank goes on
    to ask its supervisor either way. A process that never imported torch.distributed has none."""
    import sys
    import traceback

    from hpcdist.errors import chain

    for cur in chain(failure) if failure is not None else ():
        traceback.clear_frames(cur.__traceback__)  # frames still running (the caller's) are left as they are
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    try:
        abort = getattr(c10d, "_abort_process_group", None)
        if dist.get_backend() == "nccl" and abort is not None:
            abort()
        else:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the failure that matters was raised before
        log.warning("closing the failed run's process groups: %s: %s", type(exc).__name__, str(exc)[:200])
    gc.collect()  # the groups' last references, now that the frames hold none: gloo's sockets close here

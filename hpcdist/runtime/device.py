"""Which CUDA device a rank uses: one decision, made from what the scheduler left visible.

With ``--gpus-per-task=1`` or ``--gpu-bind=single:1`` Slurm gives each task one GPU, renumbered
as ``cuda:0`` in that task (``CUDA_VISIBLE_DEVICES`` has one entry), so ``cuda:LOCAL_RANK`` does
not exist for local rank 1 and up. With every GPU of the node visible, local rank ``i`` takes
``cuda:i``. The bootstrap's device, the device the NCCL group binds and the public API's device
all come from ``cuda_index``.
"""

from __future__ import annotations

from collections.abc import Mapping

from hpcdist.errors import BootstrapError


def visible_entries(env: Mapping[str, str]) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs); [] when it is unset or empty."""
    return [e.strip() for e in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]


def cuda_index(local_rank: int, env: Mapping[str, str], device_count: int) -> int:
    """The CUDA device index for `local_rank`: the local rank modulo the GPUs this task sees.

    The count is the number of ``CUDA_VISIBLE_DEVICES`` entries when the variable is set (at most
    torch's `device_count`, which drops invalid entries), else `device_count`. One visible GPU is
    always ``cuda:0``. This is each rank's preference; under NCCL the check-in then places every
    rank on a GPU of its own from all ranks' GPU UUIDs (``group.take_seats``: tasks that see a
    subset each, two ranks given one GPU refused), not guessed here.
    """
    entries = visible_entries(env)
    count = len(entries) if entries else device_count
    if device_count > 0:
        count = min(count, device_count)
    if count < 1:
        raise BootstrapError(
            f"no CUDA device is visible to local rank {local_rank} (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}, torch sees {device_count}); check the GPU request"
        )
    return local_rank % count

"""A user script on ``hpcdist.init()`` that saves a state of a known size (16 float32 tensors of
256 KiB: 4,194,304 bytes) three times: step 1 plain tensors (the same on every rank: at 2 ranks
the sharded path without DCP's planning), step 2 the same tensors as DTensors split across the
ranks (``dcp.save``), step 3 those in the background (committed by ``close``). At 1 rank the
DTensors are skipped: steps 2 and 3 save the plain state again.
"""

import torch

import hpcdist

ctx = hpcdist.init()
torch.manual_seed(0)
state = {f"w{i}": torch.randn(256, 256) for i in range(16)}  # the same on every rank
ctx.checkpoints.save(1, {"model": state})
if ctx.world_size > 1:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state.items()}
ctx.checkpoints.save(2, {"model": state})
ctx.checkpoints.save(3, {"model": state}, background=True)
ctx.close()

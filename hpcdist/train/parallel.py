"""How ``train_gpt`` spreads the model over its ranks (``params.parallel``): DDP, every rank a
whole copy, or FSDP2, each copy's parameters, gradients and optimizer state sharded.

Under FSDP2 the model is made on the meta device (shapes, no memory), sharded, and only then
given memory (``to_empty``): each rank allocates its own part and fills it from the model's
per-parameter init (``GPT.initial_value``, one whole parameter at a time), as torchtitan does, so
a rank never holds the whole model and the weights are the unsharded model's for the same seed,
at any world size. FSDP keeps a tied head tied (one parameter, registered on both modules).

FSDP2 (``fully_shard``) shards every transformer block, then the root (embeddings, final norm,
head), over a device mesh of ``dp_shard`` ranks, or of ``dp_replicate`` x ``dp_shard`` (HSDP:
sharded within a copy, all-reduced across copies), as torchtitan does. On GPUs a bf16 run uses
FSDP's ``MixedPrecisionPolicy`` (parameters all-gathered in bf16, gradients reduced in fp32) in
place of autocast; on CPUs compute stays fp32 (bf16 there costs more than it saves).

The checkpoint state of a sharded model is DCP's (``get_state_dict``): the model's DTensors and
the optimizer state keyed by parameter name, saved sharded by ``ctx.checkpoints`` and loaded
into a state of this run's layout, so it reshards to any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpcdist.model.gpt import GPT, GPTConfig
from hpcdist.store.hostmem import mark_memory, peak_memory

if TYPE_CHECKING:
    from hpcdist.runtime.job_rank import JobRank
    from hpcdist.train.params import ParallelParams, Precision


def build(cfg: GPTConfig, ctx: JobRank, parallel: ParallelParams, precision: Precision,
          compile_parts: Callable[[GPT], Any] | None = None) -> tuple[GPT, nn.Module]:
    """The model (from torch's global generator, as ``GPT(cfg)``) and the module the steps run:
    under DDP a whole copy on every rank; under FSDP2 each rank's shard, never the whole.
    `compile_parts` (``hpcdist.train.speed.compile_model``) compiles the model's parts before either wraps it."""
    before = mark_memory(ctx.device)
    if not parallel.fsdp:
        model = GPT(cfg).to(ctx.device)
        order = ready_order(model, ctx, precision) if ctx.world_size > 1 else None  # eager, before any compile
        if compile_parts is not None:
            compile_parts(model)
        net = wrap(model, ctx, parallel, precision, order)
    else:
        with torch.device("meta"):
            model = GPT(cfg)
        if compile_parts is not None:
            compile_parts(model)
        net = wrap(model, ctx, parallel, precision)
        model.to_empty(device=ctx.device)
        init_shards(model)
    held, whole = held_bytes(model)
    ctx.log.info("model set-up: this rank holds %.1f MB of the model's %.1f MB of parameters; "
                 "its peak %s memory grew %.1f MB", held / 1e6, whole / 1e6,
                 "GPU" if ctx.device.type == "cuda" else "host", (peak_memory(ctx.device) - before) / 1e6)
    return model, net


def init_shards(model: GPT) -> None:
    """Each rank's part of every parameter of a sharded (``to_empty``) model, and its buffers."""
    from torch.distributed.tensor import DTensor

    def write(p: nn.Parameter, whole: torch.Tensor) -> None:
        if isinstance(p, DTensor):
            p.to_local().copy_(local_part(whole, p))
        else:
            p.copy_(whole)

    model.init_weights(write)


def local_part(whole: torch.Tensor, p: Any) -> torch.Tensor:
    """The view of `whole` that DTensor `p`'s rank holds: ``torch.chunk`` along each sharded dim,
    as DTensor's ``Shard`` splits (no copy and no communication, unlike ``distribute_tensor``)."""
    coords = p.device_mesh.get_coordinate()
    part = whole
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            pieces = torch.chunk(part, p.device_mesh.size(mesh_dim), dim=placement.dim)
            i = coords[mesh_dim]
            part = pieces[i] if i < len(pieces) else part.narrow(placement.dim, 0, 0)
    return part


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """The bytes of parameters this rank holds (its shards under FSDP2), and the whole model's."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    held = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)
    return held, sum(p.numel() * p.element_size() for p in params)


def wrap(model: nn.Module, ctx: JobRank, parallel: ParallelParams, precision: Precision,
         order: list[int] | None = None) -> nn.Module:
    """The module the steps run: DDP around `model` (its gradient buckets laid out in `order`,
    ``ready_order``'s, from the first step), or `model` itself sharded in place by FSDP2; one rank
    alone runs `model` as it is (DDP's gradient buckets would only copy and wait)."""
    if not parallel.fsdp:
        if ctx.world_size == 1:
            return model
        with buckets_in(model, order):
            return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    replicate, shard = parallel.sizes(ctx.world_size)
    if replicate > 1:
        mesh = init_device_mesh(ctx.device.type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(ctx.device.type, (shard,), mesh_dim_names=("dp_shard",))
    policy = MixedPrecisionPolicy()
    if mixed_precision(ctx, parallel, precision):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = model.get_submodule("transformer.h")
    assert isinstance(blocks, nn.ModuleList)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if ctx.is_main:
        ctx.log.info("FSDP2: %d block(s) and the root sharded over %d rank(s)%s%s", len(blocks), shard,
                     f", {replicate} replicas (HSDP)" if replicate > 1 else "",
                     ", bf16 parameters with fp32 reduction" if policy.param_dtype is not None else "")
    return model


def ready_order(model: GPT, ctx: JobRank, precision: Precision) -> list[int]:
    """The order in which `model`'s parameters get their gradients in a backward pass (the indices
    of its trainable parameters), from one backward of a tiny batch under the loop's autocast,
    with the random generators as they were and no gradient left behind.

    DDP lays out its gradient buckets in parameter order for its first step and in this order
    from its second (its bucket rebuild). A gradient element's place in its bucket decides in
    which order the ranks' values are added (the ring all-reduce's chunks), and with three ranks
    or more a different order of addition rounds differently: so a run resumed from a checkpoint,
    whose new DDP took its first step in parameter order, drifted from the uninterrupted run in
    the last bits (measured: 3 ranks, rank 0 killed at step 78, train_gpt's losses differed from
    step 82 on, and its final model). Laid out in this order from the first step, every start
    of a run adds alike, and a resume is exact at any world size."""
    params = [p for p in model.parameters() if p.requires_grad]
    order: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i)) for i, p in enumerate(params)]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    idx = torch.zeros((1, min(8, model.cfg.context)), dtype=torch.long, device=ctx.device)
    cuda = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.autocast(ctx.device.type, dtype=dtype or torch.float32,
                                                                enabled=dtype is not None):
            model(idx, idx).backward()
    finally:
        for hook in hooks:
            hook.remove()
        for p in params:
            p.grad = None
    return order


@contextlib.contextmanager
def buckets_in(model: nn.Module, order: list[int] | None) -> Iterator[None]:
    """DDP's first bucket assignment made as its bucket rebuild makes it, from `order`: its own
    function (``_compute_bucket_assignment_by_size``, the one the rebuild calls) over the
    parameters in that order, with DDP's default caps (1 MiB for the first bucket, 25 MiB after).
    DDP asks that function once, in its constructor, and reverses what it returns; where torch
    no longer has it, DDP's own assignment stands (a resume is then exact at 2 ranks only)."""
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if not order or assign is None:
        yield
        return
    params = [p for p in model.parameters() if p.requires_grad]
    caps = [int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)), 25 * 1024 * 1024]
    buckets, limits = assign([params[i] for i in order], caps, [False] * len(order), order)
    dist._compute_bucket_assignment_by_size = lambda *_, **__: (buckets[::-1], limits[::-1])
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = assign


def mixed_precision(ctx: JobRank, parallel: ParallelParams, precision: Precision) -> bool:
    """Whether FSDP's mixed precision policy replaces autocast: bf16 on GPUs under FSDP."""
    return parallel.fsdp and ctx.device.type == "cuda" and precision == "bf16"


@contextlib.contextmanager
def gradient_sync(net: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients in this backward (`sync`), or only accumulate them locally."""
    if sync or not isinstance(net, DDP) and not hasattr(net, "set_requires_gradient_sync"):  # one rank: no sync
        yield
    elif isinstance(net, DDP):
        with net.no_sync():
            yield
    else:  # FSDP2: the flag holds until set again, so the last micro-batch turns it back on
        net.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)  # type: ignore[operator]


def clip_gradients(params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global gradient norm (over every rank's shard), clipped to `max_norm` when given."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    if isinstance(total, DTensor):  # each rank's partial norm: the whole one
        total = total.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


TIED_HEAD = "lm_head.weight"  # a tied head is the embedding: saved once, as the unsharded /model does


def checkpoint_state(model: nn.Module, opt: torch.optim.Optimizer, tied: bool) -> dict[str, Any]:
    """This rank's part of the model and optimizer state (DTensors, optimizer keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    if tied:
        msd.pop(TIED_HEAD, None)
    return {"model": msd, "optimizer": osd}


def load_checkpoint_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any], tied: bool) -> None:
    """`state` (of `checkpoint_state`'s form, filled from a checkpoint) into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=not tied))


def load_full_model(model: nn.Module, state: dict[str, Any]) -> None:
    """A whole state dict (every rank holds all of it, e.g. ``params.init``'s) into `model`,
    sharded or not: each rank keeps its own part."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))

"""Data parallelism whose gradient sum has one fixed order, so a resumed run is bit-identical.

``ddp``: parameters replicated; after backward all gradients are packed into one flat buffer in
registration order and all-reduced at once: the same layout every step, so the same summation
order. torch's DDP regroups its buckets after the first iteration (and again after a resume, at
another step), which changed the order and made 4-rank resumes differ in the last bits
(torch-cpu.md). One buffer also means one collective per step, not one per parameter.
``fsdp``: FSDP2 ``fully_shard`` per block and on the root (reduce-scatter order is fixed). The model
is built on the meta device and sharded before any parameter exists, so no rank ever holds the
whole model; each rank then fills in its shards with exactly the values a whole-model build under
the same seed would have (``materialize``), whatever the world size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor, init_device_mesh

from train_ref.model import GPT

MODES = ("ddp", "fsdp")


def build(make: Callable[[], GPT], mode: str, device: torch.device, seed: int) -> nn.Module:
    """The model of ``make()`` with its parameters initialized from ``seed``, parallelized.

    Identical initial parameters in every mode and on every world size. fsdp: meta device, then
    ``fully_shard``, then ``materialize``; ddp: built whole (every rank holds it anyway)."""
    torch.manual_seed(seed)
    if mode != "fsdp":
        return parallelize(make().to(device), mode, device)
    with torch.device("meta"):
        model = make()
    template = copy.deepcopy(model)  # on meta: free; the unsharded shapes, one module at a time
    parallelize(model, mode, device)
    model.to_empty(device=device)
    torch.manual_seed(seed)  # the replay starts where a whole build's draws would
    materialize(model, template)
    return model


@torch.no_grad()
def materialize(sharded: nn.Module, template: nn.Module) -> None:
    """Fill the local shards of ``sharded`` (after ``to_empty``) with what building ``template``'s
    module whole would have drawn from the current torch RNG.

    Replays each module's ``reset_parameters`` in registration order on a CPU copy of that one
    module (its constructor's own draws, in the constructor's order: true of torch's layers and of
    a model that builds its layers in the order it registers them) and keeps this rank's part of
    each parameter (split locally, no message). Peak extra memory: one module's parameters."""
    for mod, fresh in zip(sharded.modules(), template.modules(), strict=True):
        reset = getattr(fresh, "reset_parameters", None)
        if not callable(reset) or next(fresh.parameters(recurse=False), None) is None:
            continue
        fresh.to_empty(device="cpu", recurse=False)
        reset()
        for p, full in zip(mod.parameters(recurse=False), fresh.parameters(recurse=False), strict=True):
            if isinstance(p, DTensor):
                part = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(part)
            else:
                p.copy_(full)
        fresh.to_empty(device="meta", recurse=False)


def parallelize(model: GPT, mode: str, device: torch.device) -> nn.Module:
    if mode == "fsdp":
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    return model


def sync_grads(model: nn.Module, mode: str) -> None:
    """ddp: average gradients across ranks through one flat buffer with a fixed layout."""
    if mode != "ddp":
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # every rank must contribute the same layout
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]  # all of them, by the loop above
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n

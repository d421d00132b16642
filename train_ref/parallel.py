"""Data parallelism whose gradient sum has one fixed order, so a resumed run is bit-identical.

``ddp``: parameters replicated; after backward every gradient is all-reduced one parameter at a
time in registration order. torch's DDP regroups its buckets after the first iteration, which
changes the summation order and made 4-rank resumes differ in the last bits (torch-cpu.md).
``fsdp``: FSDP2 ``fully_shard`` per block and on the root (reduce-scatter order is fixed).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

MODES = ("ddp", "fsdp")


def parallelize(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
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
    """ddp: average gradients across ranks, one parameter at a time, always in the same order."""
    if mode != "ddp":
        return
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for sharded DTensors)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def params_digest(model: nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter, sorted by name; identical for
    any sharding. Every rank must call it (gathering shards is a collective)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = full_tensor(p.detach()).cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

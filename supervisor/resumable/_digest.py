"""The run's fingerprint: a sha256 of the full parameters, the same for any sharding and world size.

``final.json``'s ``params_sha256`` (and the drill's verdict, which compares it with an uninterrupted
run's) come from here: two runs are the same run when these digests are equal."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for sharded DTensors)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def params_digest(model: nn.Module, progress: Callable[[int], None] | None = None) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter, sorted by name; identical for
    any sharding. Every rank must call it (gathering shards is a collective), and hashes every
    whole parameter. ``progress`` hears of each parameter's bytes once hashed, the whole
    tensor's (a heartbeat tracker: a large model's digest is a long phase of its own)."""
    return tensors_digest(model.named_parameters(), progress)


def tensors_digest(
    named: Iterable[tuple[str, torch.Tensor]], progress: Callable[[int], None] | None = None
) -> str:
    """``params_digest`` of any named tensors (sharded or whole)."""
    h = hashlib.sha256()
    for name, p in sorted(named, key=lambda kv: kv[0]):
        t = full_tensor(p.detach()).cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        if progress:
            progress(p.numel() * p.element_size())
    return h.hexdigest()

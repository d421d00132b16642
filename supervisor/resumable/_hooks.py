"""The step boundary's and the DataLoader workers' injected hooks (supervisor/format/hooks.py):
loaded only when ``$SUPERVISOR_BOUNDARY_HOOK`` or ``$SUPERVISOR_WORKER_HOOK`` names one, so
production code imports nothing of the drill."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from supervisor.format.hooks import ENV_BOUNDARY_HOOK, ENV_WORKER_HOOK, RankOps, When

BoundaryHook = Callable[[int, When], None]


def no_hook(step: int, when: When) -> None:
    return None


def boundary_hook(rank: int, launch: str) -> BoundaryHook:
    """The injected hook for this rank and launch, or one that does nothing. A variable that names
    nothing importable stops the rank with one line naming it (it was set on purpose)."""
    factory = _named(ENV_BOUNDARY_HOOK)
    hook: BoundaryHook | None = (
        factory(rank, launch, RankOps(_all_reduce_zero, dist.barrier)) if factory else None
    )
    return hook or no_hook


def _all_reduce_zero() -> None:
    dist.all_reduce(torch.zeros(1))


def run_worker_hook(worker_id: int) -> None:
    """In a DataLoader worker: the injected worker hook, when one is named."""
    hook = _named(ENV_WORKER_HOOK)
    if hook is not None:
        hook(worker_id)


def _named(env: str) -> Callable[..., Any] | None:
    spec = os.environ.get(env, "")
    if not spec:
        return None
    module, _, name = spec.partition(":")
    try:
        found: Callable[..., Any] = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise SystemExit(f"resumable: ${env}={spec!r} names no hook ({e}); unset it") from None
    return found

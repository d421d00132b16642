"""The step boundary's injected hook (supervisor/format/hooks.py): loaded only when
``$SUPERVISOR_BOUNDARY_HOOK`` names one, so production code imports nothing of the drill."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from supervisor.format.hooks import ENV_BOUNDARY_HOOK, When

BoundaryHook = Callable[[int, When], None]


def no_hook(step: int, when: When) -> None:
    return None


def boundary_hook(rank: int, launch: str) -> BoundaryHook:
    """The injected hook for this rank and launch, or one that does nothing. A variable that names
    nothing importable stops the rank with one line naming it (it was set on purpose)."""
    spec = os.environ.get(ENV_BOUNDARY_HOOK, "")
    if not spec:
        return no_hook
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise SystemExit(f"resumable: ${ENV_BOUNDARY_HOOK}={spec!r} names no hook ({e}); unset it") from None
    hook: BoundaryHook | None = factory(rank, launch)
    return hook or no_hook

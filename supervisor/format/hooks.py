"""The step boundary's injection point, declared torch-free: code that must run at a rank's step
boundary (or in its DataLoader workers) but that the training library must not import (the
drill's self-inflicted hangs).

``$SUPERVISOR_BOUNDARY_HOOK`` names ``module:function``. ``Resumable.resume()`` imports it (only when
set) and calls ``function(rank, launch, ops)``, which returns a callable ``(step, When)`` or None;
the library calls it at each ``When`` of every step. ``ops`` (``RankOps``) are the rank's
collectives, so the injected code, which runs in a rank, imports no torch itself. Whoever sets the
variable (``supervisor drill``) injects the code; production code names no such module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

ENV_BOUNDARY_HOOK = "SUPERVISOR_BOUNDARY_HOOK"
# ``module:function`` called as ``function(worker_id)`` in each DataLoader worker the library sets
# up (its worker_init_fn, supervisor/resumable/_workers.py), after its signals are calmed and before
# the loader's and the user's own init: the drill's deadlocking worker. Unset, nothing is imported.
ENV_WORKER_HOOK = "SUPERVISOR_WORKER_HOOK"
# Seconds every checkpoint write sleeps before writing its shards (the drill's and the tests' knob):
# it widens the window between "save started" and "commit" so a kill lands inside it.
ENV_SAVE_DELAY = "TRAIN_REF_SAVE_DELAY_S"


class When(str, Enum):
    STEP = "step"  # after the step's heartbeat, before the ranks agree at the step boundary
    SAVE = "save"  # right after the step's async save started, before it can be committed


@dataclass(frozen=True)
class RankOps:
    """Collectives on the rank's default process group, handed to the boundary hook by the library
    (supervisor/resumable/_hooks.py): the drill's collective hang enters one or skips it."""

    all_reduce: Callable[[], object]  # an all_reduce of one zero
    barrier: Callable[[], object]  # torch.distributed.barrier itself: it, not a wrapper, is in the stack

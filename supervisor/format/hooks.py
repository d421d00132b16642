"""The step boundary's injection point, declared torch-free: code that must run at a rank's step
boundary but that the training library must not import (the drill's self-inflicted hangs).

``$SUPERVISOR_BOUNDARY_HOOK`` names ``module:function``. ``Resumable.resume()`` imports it (only when
set) and calls ``function(rank, launch)``, which returns a callable ``(step, When)`` or None; the
library calls it at each ``When`` of every step. Whoever sets the variable (``supervisor drill``)
injects the code; production code names no such module.
"""

from __future__ import annotations

from enum import Enum

ENV_BOUNDARY_HOOK = "SUPERVISOR_BOUNDARY_HOOK"


class When(str, Enum):
    STEP = "step"  # after the step's heartbeat, before the ranks agree at the step boundary
    SAVE = "save"  # right after the step's async save started, before it can be committed

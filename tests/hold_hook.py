"""A user's loop held at a step boundary (test-only): train_ref/hold.py's gate injected through the
library's step-boundary hook (``$SUPERVISOR_BOUNDARY_HOOK=hold_hook:boundary_hook``, with tests/ on
the ranks' PYTHONPATH), so a test holds a script it does not own (examples/) the way it holds the
reference trainer: every rank acknowledges, then waits until the hold file is released."""

from __future__ import annotations

from collections.abc import Callable

from supervisor.format.hooks import RankOps, When
from train_ref.hold import HoldGate


def boundary_hook(rank: int, launch: str, ops: RankOps) -> Callable[[int, When], None] | None:
    gate = HoldGate.from_env(rank, launch)
    if gate is None:
        return None

    def at(step: int, when: When) -> None:
        if when == When.STEP and gate.wanted(step):
            gate.hold(step, beat=lambda: None)  # held for seconds: well inside the test's hang timeout

    return at

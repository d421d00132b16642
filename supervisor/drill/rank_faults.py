"""Drill-only: a rank that hangs for real, at the step and place ``supervisor drill`` chose.

Injected, not imported: the drill sets ``$SUPERVISOR_BOUNDARY_HOOK`` to ``switch.HOOK`` (this
module's ``boundary_hook``) beside ``TRAIN_REF_DRILL_HANG`` (format and marker names:
supervisor/drill/switch.py), and the library's step boundary calls what it returns.
The rank blocks in a read that never returns, the way a read from a dead file server or a peer that
never sends does, so no signal cures it: read(2) is interrupted, Python runs the handlers and
retries it (PEP 475), and the SIGTERM handler only sets the preemption flag, which is looked at on a
step boundary this rank never reaches again. The other ranks wait for it in the next collective.
faulthandler's SIGUSR2 dump runs at C level, so the rank's stack still shows where it is stuck.
"""

from __future__ import annotations

import os
import time
from typing import NoReturn

from supervisor.drill.switch import ENV, Switch
from supervisor.format.atomic import atomic_write_json
from supervisor.format.hooks import When


class DrillFaults:
    def __init__(self, switch: Switch | None, rank: int, launch: str) -> None:
        self.launch = launch
        self.mine = [(h, switch.marker(h)) for h in switch.hangs if h.rank == rank] if switch else []

    @classmethod
    def from_env(cls, rank: int, launch: str) -> DrillFaults:
        text = os.environ.get(ENV)
        if not text:
            return cls(None, rank, launch)
        try:
            return cls(Switch.decode(text), rank, launch)
        except ValueError as e:
            raise SystemExit(f"resumable: {e}") from None

    def __call__(self, step: int, when: When) -> None:
        self.maybe_hang(step, when)

    def maybe_hang(self, step: int, when: When) -> None:
        """Block forever if this rank is to hang here and has not done so in an earlier launch; the
        marker says so first (what the drill waits for)."""
        for h, marker in self.mine:
            if h.step == step and h.when == when and not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(
                    marker,
                    {
                        "rank": h.rank,
                        "step": h.step,
                        "when": h.when.value,
                        "pid": os.getpid(),
                        "launch": self.launch,
                        "t": time.time(),
                    },
                )
                stuck_read()


def boundary_hook(rank: int, launch: str) -> DrillFaults | None:
    """The hook of supervisor/format/hooks.py: this rank's hangs, or None when it has none."""
    faults = DrillFaults.from_env(rank, launch)
    return faults if faults.mine else None


def stuck_read() -> NoReturn:  # named by switch.BLOCKING_FUNCTION (tests/test_hang_culprit.py)
    """Read from a pipe whose write end this process holds and never writes: no data, no EOF."""
    r, _w = os.pipe()
    while True:
        os.read(r, 1)

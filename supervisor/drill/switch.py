"""The drill's switch into the reference trainer: hangs a rank inflicts on itself.

A real hang (a rank that never reaches the next collective) cannot be injected from outside: a
SIGSTOPped rank is woken by the watchdog's own SIGCONT and then checkpoints on SIGTERM. So the drill
tells the trainer, in one environment variable, which rank hangs at which step, where (at the step
boundary, or right after that step's async save started) and how (``How``: a read that never
returns; a collective it skips while the others enter it; a DataLoader worker of it that
deadlocks). The rank side
(``supervisor/drill/rank_faults.py``, injected through ``supervisor/format/hooks.py``) writes a marker before it blocks, so the drill knows the fault
happened, and a relaunch that reaches the step again runs on. Unset, the trainer ignores all this.
The golden run gets another variable (``ENV_KEEP``): keep every checkpoint it commits, for the
comparison with a faulted run's.

Torch-free and pure apart from reading a marker: the one truth for the format, used by the drill
and the trainer alike.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from supervisor.format.hooks import When

ENV = "TRAIN_REF_DRILL_HANG"
# The golden run's: rank 0 keeps every checkpoint it commits (hard links into another folder) for the
# comparison with a faulted run's (supervisor/drill/diverge.py), whatever the trainer's retention.
ENV_KEEP = "SUPERVISOR_DRILL_KEEP"
# What the drill sets $SUPERVISOR_BOUNDARY_HOOK to (supervisor/format/hooks.py): the rank side.
HOOK = "supervisor.drill.rank_faults:boundary_hook"
# ... and $SUPERVISOR_WORKER_HOOK, for hang-loader: the DataLoader workers' side.
WORKER_HOOK = "supervisor.drill.rank_faults:worker_hook"
# The function a rank blocks in; the judge looks for it in the culprit's stack.
BLOCKING_FUNCTION = "stuck_read"
# The collective the other ranks enter and the culprit skips (hang-collective), and what the
# culprit enters instead: a different op under the same sequence number, as a data-dependent
# branch does (the same op with other sizes would fail, not hang: gloo checks the sizes).
SKIPPED_OP = "all_reduce"
INSTEAD_OP = "barrier"
SKIPPING_FUNCTION = "skip_collective"  # the culprit's, in its stack
# hang-loader: the rank sends this to its DataLoader workers; worker 0 of a rank that is to hang
# handles it by blocking forever on a lock (``LOADER_BLOCKING_FUNCTION``). Default action: ignored,
# so any other child of the rank is untouched.
LOADER_SIGNAL = signal.SIGWINCH
LOADER_BLOCKING_FUNCTION = "deadlock"
LOADER_WORKER = 0


class How(str, Enum):
    """How the culprit hangs the launch."""

    READ = "read"  # it blocks in a read that never returns
    COLLECTIVE = "collective"  # it skips a collective the others enter, and enters another one
    LOADER = "loader"  # a DataLoader worker of it blocks forever on a lock; the rank waits for its batch


@dataclass(frozen=True)
class Hang:
    rank: int
    step: int
    when: When = When.STEP
    how: How = How.READ


@dataclass(frozen=True)
class Switch:
    """The hangs of one run, and the directory their markers go to."""

    marker_dir: Path
    hangs: tuple[Hang, ...]

    def encode(self) -> str:
        return json.dumps(
            {
                "marker_dir": str(self.marker_dir),
                "hangs": [
                    {"rank": h.rank, "step": h.step, "when": h.when.value, "how": h.how.value}
                    for h in self.hangs
                ],
            }
        )

    @classmethod
    def decode(cls, text: str) -> Switch:
        """Parse the variable's value; ValueError with one line saying what is wrong."""
        try:
            d = json.loads(text)
            hangs = tuple(
                Hang(int(h["rank"]), int(h["step"]), When(h["when"]), How(h.get("how", How.READ.value)))
                for h in d["hangs"]
            )
            return cls(Path(d["marker_dir"]), hangs)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{ENV} is not a drill switch ({type(e).__name__}: {e}); unset it outside `supervisor drill`"
            ) from None

    def marker(self, h: Hang) -> Path:
        how = "" if h.how == How.READ else f"_{h.how.value}"
        return self.marker_dir / f"hang_rank_{h.rank:05d}_step_{h.step:08d}_{h.when.value}{how}.json"


@dataclass(frozen=True)
class Keep:
    """Keep every checkpoint committed in ``root``: linked into ``into`` under its own name."""

    root: Path
    into: Path

    def encode(self) -> str:
        return json.dumps({"root": str(self.root), "into": str(self.into)})

    @classmethod
    def decode(cls, text: str) -> Keep:
        """Parse the variable's value; ValueError with one line saying what is wrong."""
        try:
            d = json.loads(text)
            return cls(Path(d["root"]), Path(d["into"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{ENV_KEEP} is not a drill keep ({type(e).__name__}: {e}); unset it outside `supervisor drill`"
            ) from None


def read_marker(path: Path) -> dict[str, Any] | None:
    """What the trainer wrote before it blocked (rank, step, when, pid, launch, t), or None."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None

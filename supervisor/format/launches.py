"""How a launch ended and what it did: the records a watchdog keeps in its state file (the budget
and no-progress checks read them back) and `status` shows. Defined here, with the other on-disk
records, so that the format never imports the watchdog."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Outcome(str, Enum):
    DONE = "done"
    REQUEUE = "requeue"
    NON_RETRYABLE = "non_retryable"
    CRASH = "crash"
    HANG = "hang"
    STORAGE = "storage"  # a rank exited 74: storage failed beyond the trainer's policy
    STOPPED = "stopped"  # the watchdog itself was told to stop (SIGTERM/SIGINT)


FAILURES = frozenset({Outcome.CRASH, Outcome.HANG, Outcome.STORAGE})


@dataclass(frozen=True)
class LaunchRecord:
    """What one launch did, as kept in state.json for the budget and no-progress checks."""

    number: int
    launch_id: str
    started: float
    ended: float
    outcome: Outcome
    reason: str
    resumed_from: int | None  # newest committed checkpoint step when it started
    newest_after: int | None  # newest committed checkpoint step when it ended
    last_step: int | None  # where it died: lowest step among its unfinished ranks

    @property
    def progressed(self) -> bool:
        return self.newest_after is not None and (
            self.resumed_from is None or self.newest_after > self.resumed_from
        )

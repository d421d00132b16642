"""A watchdog's run status, as ``state.json`` records it, and the moves it may make.

::

    RESTARTING --(a launch starts)--> RUNNING --(the launch ends, the policy relaunches)--> RESTARTING
         |                               |
         +-------------+-----------------+--> DONE      (exit 0: training finished)
                                         +--> REQUEUED  (preempted and checkpointed: requeue the job)
                                         +--> STOPPED   (told to stop: SIGTERM/SIGINT)
                                         +--> FAILED    (budget, no progress, non-retryable, storage)

A watchdog starts in RESTARTING (before its first pick and launch, and between launches: the
backoff). The four on the right are terminal: a watchdog that reached one writes it and exits; the
next watchdog of the run (a requeue) starts a new history in RESTARTING. Staying in a status while
its reason changes (a retry, a launch number) is no move. ``check_move`` enforces the table:
``IllegalTransition`` names the move, a bug in the watchdog, never an operator's mistake.
"""

from __future__ import annotations

from enum import Enum


class RunStatus(str, Enum):
    RESTARTING = "restarting"
    RUNNING = "running"
    DONE = "done"
    REQUEUED = "requeued"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:  # "running" in a message, as the value it replaced
        return self.value

    @property
    def ended(self) -> bool:
        return not MOVES[self]


_ENDS = frozenset({RunStatus.DONE, RunStatus.REQUEUED, RunStatus.STOPPED, RunStatus.FAILED})
MOVES: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.RESTARTING: frozenset(
        {RunStatus.RUNNING, RunStatus.REQUEUED, RunStatus.STOPPED, RunStatus.FAILED}
    ),
    RunStatus.RUNNING: frozenset({RunStatus.RESTARTING}) | _ENDS,
    RunStatus.DONE: frozenset(),
    RunStatus.REQUEUED: frozenset(),
    RunStatus.STOPPED: frozenset(),
    RunStatus.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the table does not allow (a bug: the watchdog's code asked for it)."""

    def __init__(self, old: RunStatus, new: RunStatus) -> None:
        allowed = ", ".join(s.value for s in sorted(MOVES[old], key=list(RunStatus).index)) or "none"
        super().__init__(
            f"run status {old.value} -> {new.value} is not allowed (from {old.value}: {allowed})"
        )
        self.old, self.new = old, new


def check_move(old: RunStatus, new: RunStatus) -> RunStatus:
    """``new`` when the run may go there from ``old`` (or stays); IllegalTransition otherwise."""
    if new != old and new not in MOVES[old]:
        raise IllegalTransition(old, new)
    return new

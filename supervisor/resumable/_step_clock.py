"""Each step's own compute time and its wait for the other ranks, for the watchdog's straggler
verdict (supervisor/watch/stragglers.py): a slow rank slows every step of every rank, and its
step time is no longer than theirs; what tells it apart is that it arrives last at the step's
collective while the others wait for it there.

A step starts where the previous one ended (``step_end`` returned: the boundary's reduction let
every rank go at once), its compute ends where the rank arrives at the step's collective
(``Resumable.compute_done``, else the boundary's reduction), and the wait is the time spent in
the boundary's reduction (``Resumable.reduce``)."""

from __future__ import annotations

import time
from collections import deque

from supervisor.format.heartbeat import STEP_TIMES_KEPT, StepTime

__all__ = ["StepClock"]


class StepClock:
    """One rank's clock of its steps: the last ``keep`` steps' ``StepTime``, for its heartbeat."""

    def __init__(self, start: float, keep: int = STEP_TIMES_KEPT) -> None:
        self.recent: deque[StepTime] = deque(maxlen=keep)
        self._start = start
        self._arrived: float | None = None
        self._marked = False
        self._wait = 0.0

    def restart(self, start: float) -> None:
        """The step starts at ``start`` (``time.perf_counter``): where the boundary let this rank
        go, or where a resume's load ended. The same instant the Resumable times its steps from."""
        self._start = start
        self._arrived, self._marked, self._wait = None, False, 0.0

    def compute_done(self) -> None:
        """The trainer reached its step's collective: this step's compute ends here (the first
        call of the step counts)."""
        if not self._marked:
            self._arrived, self._marked = time.perf_counter(), True

    def reduce_started(self) -> float:
        """The boundary's reduction starts; its compute ends here unless the trainer said where."""
        now = time.perf_counter()
        if self._arrived is None:
            self._arrived = now
        return now

    def reduce_ended(self, started: float) -> None:
        """The boundary's reduction returned: its time is this step's wait for the other ranks."""
        self._wait += time.perf_counter() - started

    def step_done(self, step: int) -> tuple[StepTime, ...]:
        """Record the step that just ended; the recent steps, oldest first."""
        end = time.perf_counter()
        compute = (self._arrived if self._arrived is not None else end) - self._start
        self.recent.append(StepTime(step, round(compute, 6), round(self._wait, 6), self._marked))
        return tuple(self.recent)

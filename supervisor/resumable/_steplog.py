"""Rank 0's ``metrics.jsonl``: one line per step, and the line of a step the memory tier snapshots
only once no rank can lose that step any more (docs/tiers.md#the-memory-tier).

A snapshot is safe once every rank's copy of it is whole. This rank knows the others' only from
the ranks' next exchange of control flags at which no rank's copy is running
(``Checkpointer.settled``: the loss's ``reduce`` of the next step, or ``step_end``'s own
all-reduce). So that step's line waits for that exchange, and the lines after it wait behind it
(lines stay in step order): a rank killed mid-copy leaves no line of a step the relaunch must
train again (a step logged twice is a step trained twice). A launch killed between that exchange
and the write leaves the line unwritten: the relaunch resumes from that very snapshot and writes
the line from the state's meta (``Resumable._relog``, on any resume: the step may be a disk
checkpoint's too). Held lines are written when the run finishes or is preempted (the checkpoint
that ends it holds their steps), and
when more than ``HELD_MAX`` wait (a copy that never ends must not keep every line); a launch that
stops any other way drops them: its relaunch writes each, or trains its step again.
"""

from __future__ import annotations

from supervisor.format.appender import LineAppender

HELD_MAX = 64


class StepLog:
    def __init__(self, out: LineAppender) -> None:
        self._out = out
        self._held: list[str] = []
        self._mark = 0  # the exchange count when the held snapshot's copy began

    def write(self, line: str, after: int | None = None) -> None:
        """Write ``line`` now, or (``after``: the exchange count when its step's snapshot began;
        or lines wait already) once an exchange past that count found no copy running."""
        if after is not None:
            self._mark = max(self._mark, after) if self._held else after
        if after is None and not self._held:
            self._out.append(line)
            return
        self._held.append(line)
        if len(self._held) > HELD_MAX:
            self.release()

    def release(self, settled: int | None = None) -> None:
        """The held lines, once ``settled`` (the last exchange with no copy running) is past their
        mark (None: now)."""
        if self._held and (settled is None or settled > self._mark):
            for line in self._held:
                self._out.append(line)
            self._held.clear()

    def close(self, finished: bool) -> None:
        """The held lines when the run ``finished`` (else they are dropped: see the module), then
        the file (lines a full disk held back get their last chance)."""
        if finished:
            self.release()
        self._held.clear()
        self._out.close()

"""How parts of the watchdog end it or cut a wait short, caught by its loop (``loop.Watchdog.run``)."""

from __future__ import annotations


class Stop(Exception):
    """Stop the watchdog with ``code`` (supervisor.format.exitcodes.Exit) and the message as its verdict."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class Interrupted(Exception):
    """A stop signal (or, with --requeue-exit, a preemption notice) cut a storage retry short."""

"""What the watchdog has been told by signal, recorded by its handlers and read by its loop: a stop
(SIGTERM/SIGINT; the first one wins) or a preemption notice (SIGUSR1 unless --notice-signal)."""

from __future__ import annotations

import signal


class Signals:
    def __init__(self, notice_signal: int, requeue_exit: bool) -> None:
        self.notice_signal = notice_signal
        self.requeue_exit = requeue_exit  # a notice ends the watchdog too (exit 13), not only its launch
        self.stop: int | None = None
        self.preempt_pending = False

    def install(self) -> None:
        def stop(signum: int, _frame: object) -> None:
            if self.stop is None:
                self.stop = signum

        def preempt(_signum: int, _frame: object) -> None:
            self.preempt_pending = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(self.notice_signal, preempt)

    @property
    def interrupted(self) -> bool:
        """A wait (a backoff, a storage retry) must end now: a stop, or a notice with --requeue-exit
        (without it the notice waits for the next launch's ranks)."""
        return self.stop is not None or (self.preempt_pending and self.requeue_exit)

"""Preemption flag and stack dumps: signal handlers that only record, never act.

SIGTERM / SIGUSR1 set a flag; the training loop agrees on it across ranks at the next step boundary
and saves there (saving inside a handler would run collectives and file IO from an arbitrary point).
SIGUSR2 makes ``faulthandler`` dump every thread's stack to a per-rank file, so a watchdog can see
where a hung rank is stuck without stopping it.
"""

from __future__ import annotations

import faulthandler
import signal
from pathlib import Path
from typing import IO

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STACK_DUMP_SIGNAL = signal.SIGUSR2


class PreemptionFlag:
    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> PreemptionFlag:
        for s in PREEMPT_SIGNALS:
            signal.signal(s, self._handle)
        return self

    def ignore_further(self) -> None:
        """The exit is decided: a repeated notice (SLURM and torchrun both forward signals) must not
        reach a half-torn-down interpreter and kill the rank before it exits with its code."""
        for s in PREEMPT_SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = signum

    @property
    def set(self) -> bool:
        return self.signum is not None


def register_stack_dump(path: Path) -> IO[str]:
    """Dump all threads' stacks to ``path`` (appended) on SIGUSR2; keep the returned file open."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")  # noqa: SIM115 - must outlive this call; faulthandler writes to its fd
    faulthandler.register(STACK_DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    return f

"""Preemption flag and stack dumps: signal handlers that only record, never act.

SIGTERM / SIGUSR1 (and REQUEUE_SIGNAL's, when sbatch/job.sh sets another one) set a flag; the training loop agrees on it across ranks at the next step boundary
and saves there (saving inside a handler would run collectives and file IO from an arbitrary point).
SIGUSR2 makes ``faulthandler`` dump every thread's stack to a per-rank file, so a watchdog can see
where a hung rank is stuck without stopping it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from supervisor.format import confined
from supervisor.slurm import SlurmError, notice_signal

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STACK_DUMP_SIGNAL = signal.SIGUSR2


class PreemptionFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.signals: tuple[int, ...] = PREEMPT_SIGNALS

    def install(self, env: Mapping[str, str] = os.environ) -> str:
        """Handle SIGTERM, SIGUSR1 and the job's REQUEUE_SIGNAL (sbatch/job.sh's notice; srun
        hands it to every process of the step). Returns why REQUEUE_SIGNAL is unusable, or ""."""
        problem = ""
        try:
            extra = notice_signal(env.get("REQUEUE_SIGNAL", ""))
            self.signals = tuple(dict.fromkeys((*PREEMPT_SIGNALS, extra)))
        except SlurmError as e:
            problem = str(e)
        for s in self.signals:
            signal.signal(s, self._handle)
        return problem

    def ignore_further(self) -> None:
        """The exit is decided: a repeated notice (SLURM and torchrun both forward signals) must not
        reach a half-torn-down interpreter and kill the rank before it exits with its code."""
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = signum

    @property
    def set(self) -> bool:
        return self.signum is not None


def register_stack_dump(path: Path, within: Path) -> IO[str]:
    """Dump all threads' stacks to ``path`` (appended; opened through no link below ``within``,
    supervisor/format/confined.py) on SIGUSR2; keep the returned file open."""
    f = os.fdopen(
        confined.open_append(within, path), "a"
    )  # must outlive this call: faulthandler writes to it
    faulthandler.register(STACK_DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    return f

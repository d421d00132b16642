"""Preemption flag and stack dumps: signal handlers that only record, never act.

SIGTERM / SIGUSR1 (and REQUEUE_SIGNAL's, when sbatch/job.sh sets another one) set a flag; the training loop agrees on it across ranks at the next step boundary
and saves there (saving inside a handler would run collectives and file IO from an arbitrary point).
SIGUSR2 makes ``faulthandler`` dump every thread's stack to a per-rank file, so a watchdog can see
where a hung rank is stuck without stopping it. An uncaught exception is recorded in
``$TORCHELASTIC_ERROR_FILE`` as torch's ``@record`` would (``record_uncaught``), so every rank that
dies of an exception says which, whether its trainer wraps its main in ``@record`` or not.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO

from supervisor.format import confined
from supervisor.format.layout import ELASTIC_ERROR_FILE_ENV, STACK_DUMP_SIGNAL
from supervisor.format.notice import NoticeSignalError, notice_signal

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
        except NoticeSignalError as e:
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


def record_uncaught(env: Mapping[str, str] = os.environ) -> None:
    """From now on, an exception that ends this process's main thread is recorded before the
    previous hook prints its traceback: in ``$TORCHELASTIC_ERROR_FILE`` (torchrun sets it for each
    worker) in torch's own format (``ErrorHandler.record_exception``), unless ``@record`` wrote the
    file already, and as one line to whoever asked (``on_uncaught``: the rank's last heartbeat).
    So a rank that is gone without it, and without an exit code, died of a signal (or
    ``os._exit``): nothing else ends a Python process without an exception."""
    path, pid, previous = env.get(ELASTIC_ERROR_FILE_ENV, ""), os.getpid(), sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if os.getpid() == pid:  # not a forked child's (a DataLoader worker)
            if path and not os.path.lexists(path):  # not @record's (nor a link planted there)
                write_error_file(path, kind, value, tb)
            for tell in _TOLD:
                tell(exception_line(kind, value, tb))
        previous(kind, value, tb)

    sys.excepthook = hook


_TOLD: list[Callable[[str], None]] = []  # the current Resumable's heartbeat (``on_uncaught``)


def on_uncaught(tell: Callable[[str], None]) -> None:
    """``tell(line)`` when an exception ends the process (``record_uncaught``); replaces the last."""
    _TOLD[:] = [tell]


def exception_line(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> str:
    """'RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly (train.py:88)': the first
    line of the message, capped, and the innermost frame."""
    first = (str(value).strip().splitlines() or [""])[0]
    frames = traceback.extract_tb(tb)
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{kind.__name__}: {first}"[:MAX_LINE] + at


MAX_LINE = 300


def write_error_file(
    path: str, kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    """torch 2.13's ``ErrorHandler.record_exception`` record, best effort (a rank on its way out
    has nothing better to do with a failed write)."""
    data = {
        "message": {
            "message": f"{kind.__name__}: {value}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w", opener=confined.no_follow) as f:  # never through a link planted there
            json.dump(data, f)
    except OSError:
        pass

"""The preemption notice's signal, declared once for everyone who sends, forwards, ignores or
handles it: the job script (``REQUEUE_SIGNAL``), the watchdog (``--notice-signal``), the ranks and
their DataLoader workers.

SLURM sends it to the batch shell, which hands it to srun, which signals every process of the step.
USR2 is the watchdog's stack-dump request (the ranks' faulthandler); HUP, INT, QUIT and TERM are
torchrun's own shutdown signals; URG is ignored by default, so a process that does not expect it
survives it.
"""

from __future__ import annotations

import signal

from supervisor.errors import UserError

NOTICE_SIGNALS = ("USR1", "URG")
DEFAULT_NOTICE_SIGNAL = "USR1"


class NoticeSignalError(UserError):
    """A notice signal this toolkit refuses; ``str(e)`` names the variable and the choices."""


def notice_signal(raw: str, var: str = "REQUEUE_SIGNAL") -> signal.Signals:
    """The preemption notice's signal from its name (``USR1``, ``SIGURG``); empty is the default."""
    name = (raw.strip() or DEFAULT_NOTICE_SIGNAL).upper().removeprefix("SIG")
    if name not in NOTICE_SIGNALS:
        raise NoticeSignalError(
            f"{var}={raw!r}: use {' or '.join(NOTICE_SIGNALS)} (USR2 is the stack-dump signal; "
            "HUP, INT, QUIT and TERM make torchrun shut its workers down)"
        )
    return signal.Signals[f"SIG{name}"]

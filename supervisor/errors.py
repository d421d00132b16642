"""One error hierarchy for what a person (or the program above) must be told, each kind carrying the
exit code each program ends with for it: the one table of exceptions to exit codes (``CODES``).

- ``UserError``: bad input, configuration or state that a person fixes (a path, an option, a job
  variable); ``str(e)`` is one line naming it and the fix.
- ``StorageError``: the storage did not answer (EIO, ESTALE, a timeout, an unreachable remote) past
  the retries: not proof of anything about a checkpoint; committed checkpoints are intact; retry.
- ``IntegrityError``: bytes that are not what they claim (a checksum that differs, a pickle that
  would run code, a replica rebuilt wrong): never loaded, never trusted; a person looks at it.

The login-node commands (``cli/main.py``) and the trainer's ``Resumable`` turn an exception into
an exit code with ``exit_code(e, program)``; a subclass that means something more precise to one
program (a checkpoint of another run: 65 to the trainer) says so with its own ``codes``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import ClassVar

from supervisor.format.exitcodes import Exit


class Program(str, Enum):
    COMMAND = "command"  # the login-node commands: status, ckpt, drill, slurm
    TRAINER = "trainer"  # a rank (supervisor.resumable)
    WATCHDOG = "watchdog"


@dataclass(frozen=True)
class Codes:
    command: Exit
    trainer: Exit
    watchdog: Exit

    def of(self, program: Program) -> Exit:
        return Exit(getattr(self, program.value))


class ToolkitError(Exception):
    """Base of every error this toolkit raises for someone to act on; ``str(e)`` is one line."""

    codes: ClassVar[Codes]


class UserError(ToolkitError):
    """Bad input or state the user must fix; ``str(e)`` is one line naming the file (or option,
    or variable) and the fix."""

    codes = Codes(command=Exit.USAGE, trainer=Exit.BAD_CONFIG, watchdog=Exit.CHILD_NONRETRYABLE)


class StorageError(ToolkitError):
    """The storage did not answer past its retries; nothing is known about the checkpoints."""

    codes = Codes(command=Exit.UNREADABLE, trainer=Exit.STORAGE, watchdog=Exit.STORAGE_UNAVAILABLE)


class IntegrityError(ToolkitError):
    """Bytes that are not what they claim to be; refused, never loaded, never retried."""

    codes = Codes(command=Exit.FOUND_PROBLEM, trainer=Exit.UNTRUSTED, watchdog=Exit.CHILD_NONRETRYABLE)


def refine(base: Codes, **codes: Exit) -> Codes:
    """A kind's codes with some programs' own (a subclass's ``codes = refine(Parent.codes, trainer=...)``)."""
    return replace(base, **codes)


CODES: dict[str, Codes] = {cls.__name__: cls.codes for cls in (UserError, StorageError, IntegrityError)}


def exit_code(e: ToolkitError, program: Program) -> Exit:
    """The exit code ``program`` ends with for ``e`` (any other exception is a bug: it raises)."""
    return e.codes.of(program)

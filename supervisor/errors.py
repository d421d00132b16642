"""The one type of error a person fixes: bad input or state, reported by ``cli.main`` as one line
(``error: <message>``) with the class's exit code, never a traceback."""

from __future__ import annotations

from supervisor.format.exitcodes import Exit


class UserError(Exception):
    """Bad input or state the user must fix; ``str(e)`` is one line naming the file (or option,
    or variable) and the fix. Subclasses say what kind (StoreError, SigningKeyError, SlurmError)."""

    exit_code: int = Exit.USAGE

"""The one builder of ``python -m supervisor ...`` command lines in tests (this interpreter, so
the venv's packages; run from the repository, ``REPO``)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def supervisor_cmd(*args: str) -> list[str]:
    """``python -m supervisor ARGS``."""
    return [sys.executable, "-m", "supervisor", *args]

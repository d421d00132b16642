"""The one builder of ``python -m supervisor ...`` command lines in tests (this interpreter, so
the venv's packages; run from the repository, ``REPO``), and the free port they name."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def supervisor_cmd(*args: str) -> list[str]:
    """``python -m supervisor ARGS``."""
    return [sys.executable, "-m", "supervisor", *args]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (a rendezvous, a server, or a dead endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

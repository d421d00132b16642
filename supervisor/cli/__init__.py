"""The commands of ``python -m supervisor``, one module each."""

from supervisor.cli.main import main

__all__ = ["main"]

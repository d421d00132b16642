"""``python -m supervisor <command>``: argparse front door. Each command lives in its own module
that exposes ``register(subparsers)``; modules are imported here, never torch."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from enum import Enum

from supervisor.clash import foreign_supervisor
from supervisor.display import printable
from supervisor.errors import Program, ToolkitError, exit_code
from supervisor.format.atomic import restrict_umask
from supervisor.format.exitcodes import Exit

# One line per command: its module defines register(subparsers) and sets args.func. Only the
# module of the command asked for is imported, so `status` and `ckpt list` stay fast.
COMMANDS = {
    "ckpt": "supervisor.cli.ckpt",
    "watch": "supervisor.cli.watch",
    "status": "supervisor.cli.status",
    "drill": "supervisor.cli.drill",
    "slurm": "supervisor.cli.slurm",
}


def _help_width() -> int:
    """The width argparse would take from ``shutil.get_terminal_size``, without importing shutil:
    argparse makes a formatter for every option it adds, and shutil's import (zlib, bz2, lzma)
    cost `status` 3 ms."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return (columns if columns > 0 else 80) - 2


class _DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless it says it already (or has none)."""

    def __init__(
        self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None
    ):
        super().__init__(prog, indent_increment, max_help_position, _help_width() if width is None else width)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        shown = default.name if isinstance(default, Enum) else str(default)  # a signal: SIGUSR1, not 10
        return text if shown in text else f"{text} (default: {shown})"


class _Parser(argparse.ArgumentParser):
    """Subcommand parsers are made of this class too (argparse uses the parent's type)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def program_name(argv0: str) -> str:
    """``python -m supervisor`` or the console script's own name, whichever the user typed."""
    name = os.path.basename(argv0)
    return "python -m supervisor" if name in ("__main__.py", "") else name


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(prog=program_name(sys.argv[0]), description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if only in (None, name):
            importlib.import_module(module).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    clash = foreign_supervisor()  # before any command imports a module supervisord may have replaced
    if clash:
        print(f"error: {clash}", file=sys.stderr)
        return Exit.USAGE
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    restrict_umask()  # nothing a command (or the trainer a watchdog starts) creates is world-writable
    try:
        return int(args.func(args))
    except ToolkitError as e:  # a person's input, the storage, or bad bytes: its line and its code
        print(f"error: {printable(str(e))}", file=sys.stderr)
        return exit_code(e, Program.COMMAND)
    except OSError as e:  # an unreadable or unwritable path: one line naming it, not a traceback
        print(printable(f"error: {e.filename or ''}: {e.strerror or e}"), file=sys.stderr)
        return Exit.USAGE
    except KeyboardInterrupt:
        return 130

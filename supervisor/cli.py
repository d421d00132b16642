"""``python -m supervisor <command>``: argparse front door. Each command lives in its own module
that exposes ``register(subparsers)``; modules are imported here, never torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from supervisor.exitcodes import Exit
from supervisor.store import StoreError

# One line per command module; each defines register(subparsers) and sets args.func.
COMMAND_MODULES = (
    "supervisor.ckpt_cmd",
    "supervisor.watch_cmd",
    "supervisor.status_cmd",
    "supervisor.drill_cmd",
    "supervisor.slurm_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m supervisor", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.USAGE
    except OSError as e:  # an unreadable or unwritable path: one line naming it, not a traceback
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return Exit.USAGE
    except KeyboardInterrupt:
        return 130

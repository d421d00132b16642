"""Waiting in tests: on an event (a file, a heartbeat, a watchdog event, a held run), never on time.

The deadline of ``wait_for`` only bounds a failure: it is minutes for things that take seconds, so
it fails a test only when the product is truly broken, never because the machine is busy.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from supervisor.events import read_events
from supervisor.layout import RunDir
from train_ref import hold

T = TypeVar("T")
PATIENCE_S = 300.0
POLL_S = 0.02


def wait_for(
    cond: Callable[[], T],
    what: str,
    *,
    timeout: float = PATIENCE_S,
    proc: subprocess.Popen | None = None,
    explain: Callable[[], str] | None = None,
    poll: float = POLL_S,
) -> T:
    """Poll ``cond`` until it returns something truthy and return that. Fails at once when ``proc``
    ended first (with its output), else after ``timeout`` (with ``explain()``, if given)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            got = cond()  # it may have happened just before the end
            if got:
                return got
            out = proc.communicate()[0] if proc.stdout is not None else ""
            out = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
            raise AssertionError(f"process ended (rc {proc.returncode}) before {what}:\n{out[-4000:]}")
        if time.monotonic() > deadline:
            more = f"\n{explain()}" if explain else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{more}")
        time.sleep(poll)


def watchdog_events(root: Path, kind: str) -> list[dict]:
    """Every node's watchdog events of one kind, in file order (``supervisor/events*.jsonl``)."""
    out = []
    for path in sorted(RunDir.of(root).supervisor.glob("events*.jsonl")):
        out += [e for e in read_events(path) if e.get("event") == kind]
    return out


def wait_held(path: Path, ranks: int, step: int, **kw) -> dict[int, dict]:
    """Wait until all ``ranks`` are held after ``step`` (train_ref/hold.py); their acks by rank."""
    return wait_for(lambda: hold.held(path, ranks, step), f"{ranks} ranks held after step {step}", **kw)

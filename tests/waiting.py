"""Waiting in tests: on an event (a file, a heartbeat, a watchdog event, a held run), never on time.

The deadline of ``wait_for`` only bounds a failure: it is minutes for things that take seconds, so
it fails a test only when the product is truly broken, never because the machine is busy.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TypeVar

from supervisor.drill.faultctl import Blocked, Controller
from supervisor.format.events import read_events
from supervisor.format.layout import RunDir
from train_ref import hold

T = TypeVar("T")
PATIENCE_S = 300.0
# The bound of a wait on an event inside this process or its file system (a thread's join, a
# blocked op showing up), where no process has to start: shorter, as nothing slow stands before it.
EVENT_TIMEOUT_S = 60.0
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


def wait_fs_blocked(fs: Controller, rule: str, proc: subprocess.Popen, n: int = 1) -> list[Blocked]:
    """Wait until ``n`` operations are held by the fault filesystem's block ``rule``; fails at once,
    with ``proc``'s output, when the process ends first (``fs.wait_blocked`` would wait it out)."""

    def held() -> list[Blocked]:
        got = [b for b in fs.blocked() if rule in b.rules]
        return got if len(got) >= n else []

    return wait_for(
        held,
        f"{n} operation(s) held by faultfs rule {rule}",
        proc=proc,
        poll=0.1,
        explain=lambda: str(fs.status()),
    )


@contextmanager
def processes(
    ctx: SpawnContext | ForkContext, calls: Sequence[tuple[Callable[..., object], tuple]]
) -> Iterator[Sequence[BaseProcess]]:
    """One started process per (target, args); on the way out each is joined, all of them within
    PATIENCE_S (a hang's bound only), and any still running is killed so no test leaves one behind."""
    procs = [ctx.Process(target=target, args=args) for target, args in calls]
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        deadline = time.monotonic() + PATIENCE_S
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()

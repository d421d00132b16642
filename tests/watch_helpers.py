"""The watchdog as a process in tests: start it (optionally with the trainer's hold gate on), wait
for it with a deadline that only bounds a failure, read its events, find processes it left."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd
from waiting import PATIENCE_S

from supervisor.format.events import events_path, read_events
from train_ref import hold


def watch_argv(root: Path, watch_args: list[str], command: list[str]) -> list[str]:
    """``python -m supervisor watch --ckpt-root ROOT WATCH_ARGS -- COMMAND``."""
    return supervisor_cmd("watch", "--ckpt-root", str(root), *watch_args, "--", *command)


def start_watchdog(
    root: Path, watch_args: list[str], command: list[str], gate: Path | None = None
) -> subprocess.Popen:
    """The watchdog (``watch_argv``), output piped; with ``gate``, the trainer's hold file
    (train_ref/hold.py) is set for everything it launches."""
    env = {k: v for k, v in os.environ.items() if k != hold.ENV_HOLD_FILE}
    if gate is not None:
        env[hold.ENV_HOLD_FILE] = str(gate)
    argv = watch_argv(root, watch_args, command)
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(p: subprocess.Popen, timeout: float = PATIENCE_S) -> tuple[int, str]:
    """The watchdog's exit code and output. Past ``timeout`` it gets SIGTERM (so it stops its
    tree), then SIGKILL, and the test fails with the output."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        pytest.fail(f"watchdog did not finish in {timeout:.0f}s:\n{out.decode(errors='replace')[-5000:]}")
    return p.returncode, out.decode(errors="replace")


def events(root: Path, node: int = 0) -> list[dict]:
    return read_events(events_path(root, node))


def of(evs: list[dict], kind: str) -> list[dict]:
    return [e for e in evs if e["event"] == kind]


def leftovers(root: Path) -> list[int]:
    """Live processes whose command line mentions the run root: must be none after the watchdog."""
    needle = str(root).encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            out.append(int(name))
    return out

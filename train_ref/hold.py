"""Hold gate (test-only): stop every rank at a chosen step boundary, tell when all are held, release.

A test or the drill that needs a run to still be running when its event arrives (a kill, a
preemption notice, a time-limit signal) holds the run there instead of hoping it is not done yet.
Both sides of the protocol live here, torch-free, so the fake trainer and the tests use it too.

    TRAIN_REF_HOLD_FILE=PATH     unset: the gate is off (one None check per step, no file reads)
    PATH                         a step number N, written atomically (``hold_at``)
    PATH.rank_RRRRR.ack          {"step": N, "pid", "launch", "notice", "memory_every"}: rank R is held after step N

After step N's boundary (its heartbeat, the preemption agreement and the start of its periodic
save: an async save of step N stays uncommitted while held, a commit starts only at a step
boundary), each rank writes its ack and waits until PATH no longer says N (removed by
``release``, or rewritten with a later step to hold at next). While held it keeps beating its
heartbeat, so the watchdog sees no hang; a preemption notice that arrives while held is acted on
at the next step boundary after the release. Whether to hold is agreed by all ranks (the trainer
all-reduces the local answer), so every rank holds at the same boundary even when the file is
written while they run. A relaunch that reaches step N while PATH still says N holds again:
harmless, and a test that kills a held rank may release after the kill in either order.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.format.atomic import atomic_write_json, atomic_write_text

ENV_HOLD_FILE = "TRAIN_REF_HOLD_FILE"
POLL_S = 0.02


class HoldFileError(ValueError):
    pass


def read_hold(path: Path) -> int | None:
    """The step the file says to hold at; None when there is no file."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise HoldFileError(f"{ENV_HOLD_FILE} {path} says {text[:40]!r}: write a step number, or remove it")
    return int(text)


def ack_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.name}.rank_{rank:05d}.ack")


class HoldGate:
    """The trainer's side for one rank."""

    def __init__(self, path: Path, rank: int, launch: str = "") -> None:
        self.path, self.rank, self.launch = path, rank, launch

    @classmethod
    def from_env(cls, rank: int, launch: str = "") -> HoldGate | None:
        path = os.environ.get(ENV_HOLD_FILE)
        return cls(Path(path), rank, launch) if path else None

    def wanted(self, step: int) -> bool:
        """Whether the file says to hold after ``step`` (this rank's local view)."""
        return read_hold(self.path) == step

    def hold(
        self,
        step: int,
        beat: Callable[[], object],
        noticed: Callable[[], bool] = lambda: False,
        memory_every: int = 0,
    ) -> None:
        """Acknowledge, then wait (beating) until the file no longer says ``step``. A preemption
        notice that arrives while held (``noticed()``) is acknowledged too, so a test can release
        the ranks knowing they will act on it at the next step boundary. ``memory_every``: the
        memory tier's interval in force (Resumable.memory_every), for a test's bound on steps redone."""
        ack = {
            "step": step,
            "pid": os.getpid(),
            "launch": self.launch,
            "notice": noticed(),
            "memory_every": memory_every,
        }
        atomic_write_json(ack_path(self.path, self.rank), ack)
        while read_hold(self.path) == step:
            if not ack["notice"] and noticed():
                ack["notice"] = True
                atomic_write_json(ack_path(self.path, self.rank), ack)
            beat()
            time.sleep(POLL_S)


# ---------------------------------------------------------------- the test's side


def hold_at(path: Path, step: int) -> None:
    """Ask every rank to hold after ``step`` (before the launch, or to move a current hold on)."""
    atomic_write_text(path, f"{step}\n")


def release(path: Path) -> None:
    """Let the held ranks go on. Their acks stay: to wait for a later hold, hold at another step
    (or compare the acks' ``launch``)."""
    path.unlink(missing_ok=True)


def acks(path: Path, ranks: int) -> dict[int, dict[str, Any]]:
    """Each rank's latest ack (ranks that never held are missing)."""
    out: dict[int, dict[str, Any]] = {}
    for r in range(ranks):
        try:
            out[r] = json.loads(ack_path(path, r).read_text())
        except FileNotFoundError:
            continue
    return out


def noticed(path: Path, ranks: int, step: int) -> dict[int, dict[str, Any]] | None:
    """Every rank's ack when all ``ranks`` are held after ``step`` and have a preemption notice."""
    got = held(path, ranks, step)
    return got if got and all(a.get("notice") for a in got.values()) else None


def held(path: Path, ranks: int, step: int) -> dict[int, dict[str, Any]] | None:
    """Every rank's ack when all ``ranks`` are held after ``step`` (pids included), else None."""
    got = acks(path, ranks)
    return got if len(got) == ranks and all(a["step"] == step for a in got.values()) else None

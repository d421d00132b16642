"""The faults themselves: signals to workers or the watchdog, and damage to a checkpoint."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.layout import parse_tmp
from supervisor.format.nodesummary import read_run_heartbeats
from supervisor.store import list_checkpoints


def worker_pid(root: Path, rank: int, launch: str, watched_as: Path | None = None) -> int | None:
    """The pid of ``rank`` in the given launch, from its heartbeat (None when not yet written);
    ``watched_as``: the run dir's path as the watchdog sees it (nodesummary.read_run_heartbeats)."""
    for snap in read_run_heartbeats(root, watched_as):
        hb = snap.heartbeat
        if hb and hb.rank == rank and hb.launch_id == launch:
            return hb.pid
    return None


def signal_worker(
    root: Path, rank: int, launch: str, sig: signal.Signals, watched_as: Path | None = None
) -> int | None:
    pid = worker_pid(root, rank, launch, watched_as)
    if pid is not None:
        os.kill(pid, sig)
    return pid


def corrupt_newest(root: Path, how: Corruption) -> str:
    """Damage the newest committed checkpoint; return what was done, for the report."""
    newest = next(iter(list_checkpoints(root)), None)
    if newest is None:
        raise RuntimeError(f"{root}: no committed checkpoint to corrupt")
    return corrupt(newest.path, how)


def tmp_save_in_flight(root: Path, min_step: int) -> bool:
    """True while a checkpoint of at least ``min_step`` is being written (its tmp dir exists)."""
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any((t := parse_tmp(n)) is not None and t.step >= min_step for n in names)

"""The faults themselves: signals to workers or the watchdog, and damage to a checkpoint."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from supervisor.format.layout import DCP_METADATA, parse_tmp
from supervisor.format.nodesummary import read_run_heartbeats
from supervisor.store import list_checkpoints


def worker_pid(root: Path, rank: int, launch: str) -> int | None:
    """The pid of ``rank`` in the given launch, from its heartbeat (None when not yet written)."""
    for snap in read_run_heartbeats(root):
        hb = snap.heartbeat
        if hb and hb.rank == rank and hb.launch_id == launch:
            return hb.pid
    return None


def signal_worker(root: Path, rank: int, launch: str, sig: signal.Signals) -> int | None:
    pid = worker_pid(root, rank, launch)
    if pid is not None:
        os.kill(pid, sig)
    return pid


def corrupt_newest(root: Path, how: str) -> str:
    """Damage the newest committed checkpoint; return what was done, for the report."""
    newest = next(iter(list_checkpoints(root)), None)
    if newest is None:
        raise RuntimeError(f"{root}: no committed checkpoint to corrupt")
    shards = sorted(newest.path.glob("*.distcp"), key=lambda p: p.stat().st_size, reverse=True)
    if how == "delete-metadata":
        (newest.path / DCP_METADATA).unlink()
        return f"deleted {newest.name}/{DCP_METADATA}"
    if not shards:
        raise RuntimeError(f"{newest.path}: no .distcp shard to damage")
    target = shards[0]
    size = target.stat().st_size
    if how == "truncate":
        os.truncate(target, size // 2)
        return f"truncated {newest.name}/{target.name} from {size} to {size // 2} bytes"
    if how == "bitflip":
        with open(target, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))
        return f"flipped one bit at byte {size // 2} of {newest.name}/{target.name}"
    raise ValueError(f"unknown corruption '{how}'")


def tmp_save_in_flight(root: Path, min_step: int) -> bool:
    """True while a checkpoint of at least ``min_step`` is being written (its tmp dir exists)."""
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any((t := parse_tmp(n)) is not None and t.step >= min_step for n in names)

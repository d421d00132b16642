"""The trainer's side of the watchdog's recovery breakdown: when this rank's process started,
finished its imports, had its process group and its state (``Mark``; the first step is marked by
the HeartbeatWriter itself). Imported after torch (train.py imports it with the other train_ref
modules), so the import time below is "torch imported"."""

from __future__ import annotations

import os
import time

import torch  # noqa: F401  (imported before IMPORTED is taken, whoever imports this module first)

from supervisor.format.heartbeat import HeartbeatWriter, Mark

IMPORTED = time.time()


def process_started() -> float | None:
    """This process's creation as a wall time (/proc/self/stat's start, in clock ticks since
    boot, against CLOCK_BOOTTIME now); None where /proc says nothing."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return time.time() - since


def started(hb: HeartbeatWriter) -> None:
    """Call once the process group is up: records the process start, the imports and now."""
    at = process_started()
    if at is not None:
        hb.mark(Mark.WORKER_STARTED, at)
    hb.mark(Mark.TORCH_IMPORTED, IMPORTED)
    hb.mark(Mark.RENDEZVOUS_DONE)


def loaded(hb: HeartbeatWriter) -> None:
    """Call once the checkpoint is loaded (or none was): the next beat carries it."""
    hb.mark(Mark.STATE_LOADED)

"""Small collectives at a decision point, during which a waiting rank keeps its heartbeat alive.

A rank that has done its part of a long phase (its share of a deep verify, its files of a commit)
and waits for its peers is not hung: its peers are the ones working, and their own heartbeats
say whether they progress. Without a beat while it waits, a rank that finished first would look
silent for as long as the slowest peer needs, and a hang verdict would name it beside (or before)
the rank really stuck in a read. So while blocked in one of these collectives a helper thread
beats for it (``beat`` is throttled by the heartbeat writer itself). Only here: these waits sit
between two pieces of this module's own work, so a peer that never arrives is either dead (the
watchdog sees its process go) or silent in its own heartbeat.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")
KEEPALIVE_S = 0.5


@contextmanager
def beating(beat: Callable[[], object], interval_s: float = KEEPALIVE_S) -> Iterator[None]:
    """Call ``beat`` every ``interval_s`` from a helper thread until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            beat()

    t = threading.Thread(target=run, name="heartbeat-while-waiting", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def gather(obj: T, group: dist.ProcessGroup | None, beat: Callable[[], object]) -> list[T]:
    """Every rank's ``obj``, by rank, on every rank."""
    out: list[Any] = [None] * dist.get_world_size(group)
    with beating(beat):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: T | None, group: dist.ProcessGroup | None, beat: Callable[[], object]) -> T:
    """Rank 0's ``obj`` on every rank (the others pass None)."""
    box: list[Any] = [obj]
    with beating(beat):
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]

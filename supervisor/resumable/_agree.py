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

import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
KEEPALIVE_S = 0.5
_LEN = 8  # bytes of the length in front of a packed object


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


def gather_to_root(obj: T, group: dist.ProcessGroup | None, beat: Callable[[], object]) -> list[T] | None:
    """Every rank's ``obj``, by rank, on rank 0 (None on the others).

    Linear in the world size N: each rank sends one buffer and rank 0 receives N, where an
    all-gather hands every rank all N objects (N^2 over the job: each commit sent 4,096 ranks'
    file lists to each of 4,096 ranks). Not ``dist.gather_object``: it all-gathers every rank's
    size first (N sizes to each rank); here one MAX all-reduce of a single size is enough, as each
    buffer carries its own length (``_pack``)."""
    world = dist.get_world_size(group)
    with beating(beat):
        padded = _padded(obj, group)
        width = padded.numel()
        received = torch.empty(world * width, dtype=torch.uint8) if dist.get_rank(group) == 0 else None
        dist.gather(
            padded, None if received is None else list(received.split(width)), group=group, group_dst=0
        )
    return None if received is None else unpack_all(received, world)


def all_gather(obj: T, group: dist.ProcessGroup | None, beat: Callable[[], object]) -> list[T]:
    """Every rank's ``obj``, by rank, on every rank: N objects to each of N ranks, for the rare
    exchange where each rank needs them all (a load on another layout merges every rank's share of
    the indexes, safe_load.every_index). Sizes as ``gather_to_root``'s."""
    world = dist.get_world_size(group)
    with beating(beat):
        padded = _padded(obj, group)
        received = torch.empty(world * padded.numel(), dtype=torch.uint8)
        dist.all_gather(list(received.split(padded.numel())), padded, group=group)
    return unpack_all(received, world)


def _padded(obj: object, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``obj`` packed (``_pack``) and padded to the widest rank's: one MAX all-reduce of a size."""
    payload = _pack(obj)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    padded = torch.zeros(int(size.item()), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    return padded


def _pack(obj: object) -> torch.Tensor:
    """``obj`` pickled, behind its length (8 bytes, little-endian), as a byte tensor."""
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(len(data).to_bytes(_LEN, "little") + data), dtype=torch.uint8)


def unpack_all(received: torch.Tensor, count: int) -> list[Any]:
    """The ``count`` objects ``_pack`` made, received side by side, each padded to the same width."""
    raw = received.numpy().data
    width = len(raw) // count
    out = []
    for start in range(0, count * width, width):
        n = int.from_bytes(raw[start : start + _LEN], "little")
        out.append(pickle.loads(raw[start + _LEN : start + _LEN + n]))  # our ranks' (as all_gather_object)
    return out


def broadcast(obj: T | None, group: dist.ProcessGroup | None, beat: Callable[[], object]) -> T:
    """Rank 0's ``obj`` on every rank (the others pass None)."""
    box: list[Any] = [obj]
    with beating(beat):
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def first_failure(
    mine: T | None, group: dist.ProcessGroup | None, beat: Callable[[], object]
) -> tuple[int, T] | None:
    """The lowest rank whose ``mine`` is not None (what went wrong there), with its ``mine``, on
    every rank; None when no rank has one. When none has, the cost is one all-reduce of a single
    number (logarithmic in the world size); the object is sent, by a broadcast from that rank,
    only when one has."""
    world = dist.get_world_size(group)
    first = torch.tensor([dist.get_rank(group) if mine is not None else world], dtype=torch.int64)
    with beating(beat):
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        rank = int(first.item())
        if rank == world:
            return None
        box: list[Any] = [mine]
        dist.broadcast_object_list(box, group=group, group_src=rank)
    return rank, box[0]

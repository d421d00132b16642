"""A relaunch's recovery, broken down: where "a rank died -> training again" spends its time.

The watchdog notes its own moments (the failure detected, the tree killed, the checkpoint
picked, the command started); the ranks note theirs in their heartbeats (``Mark``: process
created, imports done, process group up, state loaded, first step). Pure functions of those
wall times (one host's clock: only this host's ranks count).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum

from supervisor.format.heartbeat import Heartbeat, Mark


class Moment(str, Enum):
    """The phases of a recovery, in order; each ends at its moment."""

    FAILED = "failed"  # the failed rank's last heartbeat (dead or hung): when it was last seen well
    DETECTED = "detected"  # the watchdog's verdict on the failed launch
    TREE_KILLED = "tree_killed"  # nothing of it is left
    BACKED_OFF = "backed_off"  # the restart policy's wait (none after a lone failure)
    CHECKPOINT_PICKED = "checkpoint_picked"
    PROCESS_STARTED = "process_started"  # the command (torchrun) started
    # the ranks' processes (under torchrun: after its own imports and rendezvous)
    WORKER_STARTED = Mark.WORKER_STARTED.value
    TORCH_IMPORTED = Mark.TORCH_IMPORTED.value
    RENDEZVOUS_DONE = Mark.RENDEZVOUS_DONE.value
    STATE_LOADED = Mark.STATE_LOADED.value
    FIRST_STEP = Mark.FIRST_STEP.value


RANK_MOMENTS = tuple(m for m in Moment if m.value in {k.value for k in Mark})
LABELS = {m.value: m.value.replace("_", " ") for m in Moment}
TOTAL = "total"


def rank_moments(beats: Iterable[Heartbeat], host: str) -> dict[Moment, float]:
    """Each rank moment that every rank of this host reached, at the slowest one's time (the
    group goes on together: it trains again when its last rank does)."""
    local = [b for b in beats if b.host == host]
    out: dict[Moment, float] = {}
    for m in RANK_MOMENTS:
        times = [b.marks.get(m.value) for b in local]
        if local and all(t is not None for t in times):
            out[m] = max(t for t in times if t is not None)
    return out


def breakdown(at: Mapping[Moment, float]) -> dict[str, float]:
    """Seconds per phase, in order, from FAILED (else from DETECTED: no rank was seen fail):
    each from the latest moment before it (a moment already passed before that, e.g. a process
    started ahead of the failure, takes 0 s), and the total to the last moment reached. Moments
    not reached are left out."""
    if Moment.DETECTED not in at:
        return {}
    start = at.get(Moment.FAILED, at[Moment.DETECTED])
    out: dict[str, float] = {}
    prev = start
    for m in Moment:
        if m in at and m != Moment.FAILED and (m != Moment.DETECTED or Moment.FAILED in at):
            out[m.value] = round(max(0.0, at[m] - prev), 3)
            prev = max(prev, at[m])
    out[TOTAL] = round(prev - start, 3)
    return out


def complete(at: Mapping[Moment, float]) -> bool:
    return Moment.FIRST_STEP in at


def describe(phases: Mapping[str, float]) -> str:
    """'4.12s to the first step: tree killed 0.05s, checkpoint picked 0.21s, ...'; '' for none."""
    if TOTAL not in phases:
        return ""
    order = [m.value for m in Moment if m.value in phases]  # JSON files may sort their keys
    parts = [f"{LABELS[k]} {phases[k]:.2f}s" for k in order]
    end = "to the first step" if Moment.FIRST_STEP.value in phases else "without reaching the first step"
    return f"{phases[TOTAL]:.2f}s {end}: " + ", ".join(parts)

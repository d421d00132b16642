"""Which ranks are stragglers, as a pure function of their recent step timings.

A slow rank slows every step of every rank: its step time is everyone's. What tells it apart is
where the time goes: it computes longer (``StepTime.compute_s``, from the step's start to its
arrival at the step's collective) while its peers wait for it in the collective. So each rank is
compared with the median of its peers over its last ``window`` steps:

- **compute**: its own compute (trainer-marked, ``Resumable.compute_done``) is ``factor`` times
  its peers' or more: the rank, its CPU or its GPU is slow;
- **network**: it computes as fast as its peers but arrives at the step boundary late by
  ``factor - 1`` of their compute or more, so it leaves the collectives late: its link is slow;
- **late**: it arrives late, and the trainer does not mark its compute, so compute and network
  cannot be told apart (the rank's wait inside the trainer's own collectives counts as compute).

Each rank's window is summarised by a trimmed mean (``trim`` of its steps dropped at each end): a
garbage collection or a burst of another process on a shared machine is a spike, and a spike is
not a straggler; a rank throttled one step in three (a CPU quota) still is. A rank is flagged
only once it scored ``factor`` or more in ``hold`` judgements in a row, each on a newer window: on
short steps a window is under a second, and one second of a busy machine filled one (a clean run
on 2 cores was flagged, 1.56x); three windows apart are what "sustained" means. A flag stays
until the score falls under ``clear`` (hysteresis: a rank near the threshold does not flap). Nothing here
reads a file or a clock; ``straggler_watch.py`` gathers the timings and acts on the verdicts.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from supervisor.format.heartbeat import StepTime

DEFAULT_FACTOR = 1.3
DEFAULT_WINDOW = 20
DEFAULT_TRIM = 0.1
DEFAULT_HOLD = 3


class Kind(str, Enum):
    COMPUTE = "compute"
    NETWORK = "network"
    LATE = "late"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Params:
    factor: float = DEFAULT_FACTOR  # flag at this many times the peers' median (0: never)
    window: int = DEFAULT_WINDOW  # the steps each rank is judged on
    trim: float = DEFAULT_TRIM  # of the window, dropped at each end before the mean
    hold: int = DEFAULT_HOLD  # judgements in a row, each on a newer window, before a flag

    @property
    def clear(self) -> float:
        """A flagged rank is cleared under this score: two thirds of the way back to 1."""
        return 1.0 + (self.factor - 1.0) / 3.0


@dataclass(frozen=True)
class Score:
    """One rank against its peers over its last ``window`` steps."""

    rank: int
    compute_s: float  # its trimmed mean
    peers_compute_s: float  # the median of its peers' trimmed means
    lateness: float  # how much later than its peers it arrives at the boundary, in peers' computes
    marked: bool  # the trainer marked its compute on every step of the window
    first_step: int
    last_step: int

    @property
    def ratio(self) -> float:
        return self.compute_s / self.peers_compute_s if self.peers_compute_s > 0 else 1.0

    def kind_and_value(self) -> tuple[Kind, float]:
        """What is slow about it and how much (on the scale of ``factor``): its compute ratio, or
        one plus its lateness, whichever is larger."""
        late = 1.0 + self.lateness
        if self.ratio >= late:
            return (Kind.COMPUTE if self.marked else Kind.LATE), self.ratio
        return (Kind.NETWORK if self.marked else Kind.LATE), late


@dataclass(frozen=True)
class Verdict:
    """A rank that scored ``factor`` or more: a suspect until ``seen`` reaches ``Params.hold``,
    then a straggler (``flagged``)."""

    rank: int
    kind: Kind
    value: float  # compute ratio, or 1 + lateness
    since_step: int  # the last step of the first window that scored it factor or more
    step: int  # the last step of the window that last judged it
    seen: int = 1  # judgements in a row, each on a newer window, that scored it factor or more

    def flagged(self, params: Params) -> bool:
        return self.seen >= params.hold

    def describe(self, host: str = "") -> str:
        where = f" on {host}" if host else ""
        if self.kind == Kind.COMPUTE:
            what = f"computes {self.value:.2f}x its peers' median"
        elif self.kind == Kind.NETWORK:
            what = (
                f"computes as fast as its peers but arrives {self.value - 1:.0%} of a step's compute "
                "late at the step boundary: its collectives end late (network?)"
            )
        else:
            what = (
                f"arrives {self.value - 1:.0%} of a step's compute late at the step boundary (compute "
                "or network: the trainer does not mark its compute)"
            )
        return f"rank {self.rank}{where} {what}, since step {self.since_step}"


def window_of(times: Sequence[StepTime], window: int) -> list[StepTime] | None:
    """The last ``window`` distinct steps, oldest first (a repeated step: its last record), or None
    when there are fewer."""
    by_step = {t.step: t for t in times}
    if len(by_step) < window or window <= 0:
        return None
    return [by_step[s] for s in sorted(by_step)[-window:]]


def trimmed_mean(values: Sequence[float], trim: float) -> float:
    """The mean of ``values`` without the ``trim`` fraction (rounded down) at each end."""
    xs = sorted(values)
    k = int(len(xs) * trim)
    kept = xs[k : len(xs) - k] or xs
    return sum(kept) / len(kept)


def scores(series: Mapping[int, Sequence[StepTime]], params: Params) -> dict[int, Score]:
    """Each rank with a full, current window against its peers (ranks whose window ends more than
    a window behind the newest are left out: a rank that stopped reporting is no peer). Needs two
    ranks at least."""
    windows = {r: w for r, t in series.items() if (w := window_of(t, params.window)) is not None}
    if not windows:
        return {}
    newest = max(w[-1].step for w in windows.values())
    windows = {r: w for r, w in windows.items() if w[-1].step > newest - params.window}
    if len(windows) < 2:
        return {}
    compute = {r: trimmed_mean([t.compute_s for t in w], params.trim) for r, w in windows.items()}
    wait = {r: trimmed_mean([t.wait_s for t in w], params.trim) for r, w in windows.items()}
    out = {}
    for r, w in windows.items():
        peers = [p for p in windows if p != r]
        peer_compute = statistics.median(compute[p] for p in peers)
        peer_wait = statistics.median(wait[p] for p in peers)
        lateness = (peer_wait - wait[r]) / peer_compute if peer_compute > 0 else 0.0
        out[r] = Score(
            rank=r,
            compute_s=compute[r],
            peers_compute_s=peer_compute,
            lateness=lateness,
            marked=all(t.marked for t in w),
            first_step=w[0].step,
            last_step=w[-1].step,
        )
    return out


def judge(
    series: Mapping[int, Sequence[StepTime]], before: Mapping[int, Verdict], params: Params
) -> dict[int, Verdict]:
    """The stragglers and suspects now (``flagged`` tells them apart), from the last judgement's
    (``before``). A rank scoring ``factor`` or more is a suspect, seen once more when its window is
    newer than the last that scored it; a suspect under ``factor`` is dropped; a straggler stays
    while it scores ``clear`` or more (its kind and value updated). A rank that cannot be judged
    now (too few steps since a relaunch) keeps its verdict until it can; one that no longer
    reports at all is dropped. ``factor`` 0: none."""
    if params.factor <= 0:
        return {}
    now = scores(series, params)
    out: dict[int, Verdict] = {r: v for r, v in before.items() if r not in now and r in series}
    for r, s in now.items():
        kind, value = s.kind_and_value()
        was = before.get(r)
        if was is not None and was.flagged(params):
            if value >= params.clear:
                out[r] = replace(was, kind=kind, value=value, step=s.last_step)
        elif value >= params.factor:
            newer = was is None or s.last_step > was.step
            since = was.since_step if was else s.last_step
            seen = (was.seen if was else 0) + int(newer)
            out[r] = Verdict(r, kind, value, since, s.last_step, seen)
    return out


def stragglers(verdicts: Mapping[int, Verdict], params: Params) -> dict[int, Verdict]:
    """The flagged ones of ``judge``'s verdicts (the suspects left out)."""
    return {r: v for r, v in verdicts.items() if v.flagged(params)}

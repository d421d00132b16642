"""Which host a failure is pinned on, as pure functions of what the watchdogs logged (their
``root_cause`` and ``hang`` events) and what the coordinator saw (a node lost, SLURM's node
state, a straggler verdict). The coordinator (``coordinator.py``) groups one failure's evidence
(an *episode*: under a roster, one generation's end) and records the incidents in the run's
bad-node list (supervisor/format/badnodes.py). No evidence, no incident: a failure that cannot be
pinned (two hosts' ranks failing at the same moment) leaves every host alone.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from supervisor.format import eventtypes as ev
from supervisor.format.badnodes import Incident, Why
from supervisor.format.eventnames import EventName
from supervisor.format.eventtypes import Event, Logged

# Two hosts' first failures this close (seconds, wall clocks of two nodes) are a tie: neither is
# pinned, unless one was a kill (a signal is dated at its rank's last beat, before it struck).
TIE_S = 0.05


@dataclass(frozen=True)
class Failure:
    """One node's evidence about a failed launch."""

    host: str
    at: float  # when its first rank failed (root cause), or when the hang was found
    kind: str  # EventName.ROOT_CAUSE or EventName.HANG
    text: str  # the event's message
    signal: bool = False  # its first rank was killed by a signal
    culprit: bool = False  # a hang whose culprit is one of this node's ranks


def failure_of(host: str, logged: Logged[Event]) -> Failure | None:
    """The evidence in one watchdog event (``host``: the node that logged it), or None."""
    e, msg = logged.event, logged.msg[:300]
    if isinstance(e, ev.RootCause) and e.failed_at:
        return Failure(host, e.failed_at, EventName.ROOT_CAUSE, msg, signal=e.signal)
    if isinstance(e, ev.Hang):
        return Failure(host, e.detected, EventName.HANG, msg, culprit=bool(e.culprits))
    return None


def attribute(
    failures: Sequence[Failure], lost: Collection[str], job: str, now: float | None = None
) -> list[Incident]:
    """The incidents of one episode. A node lost in it carries the blame (its own incident, made
    when it was found lost): the others' ranks failed because it went. Else the hosts whose ranks
    a hang's stack dumps name as culprits. Else the host whose rank failed first, by a clear
    margin (``TIE_S``) or by a kill."""
    if lost:
        return []
    now = time.time() if now is None else now
    culprits = sorted({f.host for f in failures if f.kind == EventName.HANG and f.culprit})
    if culprits:
        return [
            Incident(
                h, (Why.HANG.value,), now, job, tuple(f.text for f in failures if f.host == h and f.culprit)
            )
            for h in culprits
        ]
    causes = sorted((f for f in failures if f.kind == EventName.ROOT_CAUSE), key=lambda f: f.at)
    if not causes:
        return []
    first = causes[0]
    rival = next((f for f in causes if f.host != first.host), None)
    if rival is not None and rival.at - first.at < TIE_S and not first.signal:
        return []
    after = f"; {rival.host} failed {rival.at - first.at:.2f}s later" if rival is not None else ""
    return [Incident(first.host, (Why.DIED_FIRST.value,), now, job, (f"{first.text}{after}",))]


def lost_incident(host: str, evidence: str, job: str, now: float) -> Incident:
    why = Why.SLURMD if evidence.startswith("SLURM says") else Why.LOST
    return Incident(host, (why.value,), now, job, (f"node lost: {evidence}",))


def straggler_incident(logged: Logged[Event], job: str, now: float) -> Incident | None:
    """A straggler verdict of the judge (node 0's ``straggler`` event) as an incident on its host."""
    e = logged.event
    if not isinstance(e, ev.Straggler) or not e.host:
        return None
    return Incident(e.host, (Why.STRAGGLER.value,), now, job, (logged.msg[:300],))


def slurm_down(state: str) -> bool:
    """Whether SLURM's node state (``scontrol show node``'s State, e.g. ``IDLE``, ``MIXED*``,
    ``DOWN*+DRAIN``) says its slurmd does not respond: DOWN, FAIL, or the ``*`` of NOT_RESPONDING."""
    words = set(state.replace("*", "+NOT_RESPONDING").upper().split("+"))
    return bool(words & {"DOWN", "FAIL", "FAILING", "NOT_RESPONDING"})


def slurm_states(show: Mapping[str, Mapping[str, str]], hosts: Sequence[str]) -> dict[str, str]:
    """The hosts whose slurmd SLURM says is down, with its state word, from ``scontrol show node``'s
    records by node name."""
    out = {}
    for h in hosts:
        state = show.get(h, {}).get("State", "")
        if state and slurm_down(state):
            out[h] = state
    return out

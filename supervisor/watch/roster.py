"""``watch --roster KEY``: this node launches only when the run's roster (supervisor/format/roster.py,
written by the SLURM job's coordinator) lists it in a generation newer than its last launch, at the
node rank it gives; listed as a spare (or left out), it waits, keeping a standby's ranks started
with their imports done, until a generation takes it in or the roster says stop.

Its readiness is the node summary: each wait publishes the generation it waits for (written at
once, not at the next interval), so the coordinator sees every training node ready, or a silent one
lost, and writes the next generation. The wait itself is a poll of one small file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.format import events
from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog
from supervisor.format.nodesummary import ROLE_OUT, ROLE_SPARE, ROLE_TRAIN
from supervisor.format.roster import GroupFacts, Roster, read_roster
from supervisor.store.ioerrors import describe
from supervisor.watch.signals import Signals

POLL_S = 0.05

Publish = Callable[..., None]
Save = Callable[..., None]


@dataclass(frozen=True)
class Stopped:
    """The roster said stop: exit with ``code``."""

    code: int
    reason: str


class RosterFollower:
    def __init__(
        self,
        root: Path,
        key: str,
        node: int,
        log: EventLog,
        save: Save,
        publish: Publish,
        poke: Callable[[], None],
    ):
        self.root, self.key, self.node, self.log = root, key, node, log
        self.save, self.publish, self.poke = save, publish, poke
        self.generation = 0  # of this node's last launch
        self.stands_in_for: int | None = None  # the lost node whose node rank this one took in it
        self._said: tuple[int, str] | None = None  # the generation and role last said
        self._problem = ""  # why the roster cannot be read, said once

    def turn(self, signals: Signals, keep_standby: Callable[[bool], None]) -> GroupFacts | Stopped | None:
        """Wait for this node's next launch: its group's facts; Stopped when the roster says so;
        None when a stop signal (or, with --requeue-exit, a notice) cut the wait short.
        ``keep_standby(wanted)``: each poll, a standby kept started (a training node and a spare)
        or dropped (a node left out)."""
        wait = self.generation + 1
        self.publish(roster_wait=wait)
        self.poke()
        while True:
            if signals.interrupted:
                return None
            roster = self._read()
            if roster is not None and roster.key == self.key:
                if roster.stop:
                    self.publish(roster_wait=0)
                    return Stopped(roster.exit_code or 0, f"the job's roster says stop: {roster.reason}")
                facts = roster.facts(self.node) if roster.generation >= wait else None
                if facts is not None:
                    self.generation = roster.generation
                    self.stands_in_for = _stood_in_for(roster, self.node)
                    self._joined(roster, facts)
                    return facts
                self._waiting(roster)
            keep_standby(self._said is None or self._said[1] != ROLE_OUT)
            time.sleep(POLL_S)

    def _read(self) -> Roster | None:
        try:
            roster = read_roster(self.root)
        except (OSError, ValueError) as e:
            problem = describe(e) if isinstance(e, OSError) else str(e)
            if problem != self._problem:
                events.say(f"[supervisor] roster not readable ({problem}); waiting for a good one")
            self._problem = problem
            return None
        self._problem = ""
        return roster

    def _joined(self, roster: Roster, facts: GroupFacts) -> None:
        self.publish(role=ROLE_TRAIN, roster_gen=roster.generation, roster_wait=0)
        self._said = (roster.generation, ROLE_TRAIN)
        self.log.emit(
            ev.RosterJoined(
                generation=roster.generation,
                node_rank=facts.node_rank,
                nnodes=facts.nnodes,
                master=f"{facts.master_addr}:{facts.master_port}",
                replaced=dict(roster.replaced),
            ),
            f"roster generation {roster.generation}: this node ({roster.host(self.node)}) trains as node rank "
            f"{facts.node_rank} of {facts.nnodes}, group at {facts.master_addr}:{facts.master_port}"
            + (f" ({roster.reason})" if roster.reason else ""),
        )

    def _waiting(self, roster: Roster) -> None:
        """Said once per generation: this node is a spare (or left out) in it, or waits for the
        next one."""
        role = ROLE_SPARE if self.node in roster.spares else ROLE_OUT if self.node not in roster.nodes else ""
        if not role or self._said == (roster.generation, role):
            return
        self._said = (roster.generation, role)
        self.publish(role=role)
        self.poke()
        what = (
            "waits as a spare, its standby's imports done"
            if role == ROLE_SPARE
            else "is left out (not a spare)"
        )
        reason = f"roster generation {roster.generation}: this node ({roster.host(self.node)}) {what}"
        self.save(reason=reason)
        self.log.emit(ev.Spare(generation=roster.generation, role=role), reason)


def _stood_in_for(roster: Roster, node: int) -> int | None:
    """The node whose place ``node`` takes in ``roster``'s generation (its host replaced by this
    one's), or None: its memory snapshots are the ones this node's ranks resume from."""
    lost = [h for h, by in roster.replaced.items() if by == roster.host(node) and h in roster.hosts]
    return roster.hosts.index(lost[0]) if lost else None

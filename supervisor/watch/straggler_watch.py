"""The straggler verdict of a run, kept by node 0's watchdog (the judge): every summary interval it
gathers each rank's recent step timings (its own node's heartbeats, the other nodes' summaries),
hands them to the pure judge (stragglers.py), says each rank newly flagged or cleared in the event
log (``straggler``, ``straggler_cleared``, naming the rank and its host) and publishes the flags in
its node summary, where `status` shows them. One judge reads N summaries per interval; N judges
would read N squared."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase, StepTime
from supervisor.format.nodesummary import StragglerNote, newest_per_rank, read_summary, summary_paths
from supervisor.watch.stragglers import Params, Verdict, judge, stragglers

# Beats older than this many summary intervals (plus a margin) are no evidence: their rank has
# stopped reporting, or its node has.
FRESH_INTERVALS = 3
FRESH_MARGIN_S = 10.0

Publish = Callable[..., None]  # the node summary's news (Watchdog._publish)


class StragglerWatch:
    """Node 0's straggler verdicts: what it flags now, the hosts its ranks were last seen on."""

    def __init__(
        self, root: Path, node: int, log: EventLog, params: Params, interval_s: float, publish: Publish
    ):
        self.root, self.node, self.log, self.params = root, node, log, params
        self.interval_s, self.publish = interval_s, publish
        self.judged: dict[int, Verdict] = {}  # the last judgement: stragglers and suspects
        self.flagged: dict[int, Verdict] = {}  # its stragglers
        self.hosts: dict[int, str] = {}
        self._due = 0.0

    @property
    def judging(self) -> bool:
        """Only node 0 judges (one reader of N summaries), and only with a factor."""
        return self.node == 0 and self.params.factor > 0

    def check(self, local: list[Heartbeat]) -> None:
        """Judge once per summary interval (each call is a monitor poll)."""
        now = time.monotonic()
        if not self.judging or now < self._due:
            return
        self._due = now + self.interval_s
        series = self.gather(local, time.time())
        self.judged = judge(series, self.judged, self.params)
        verdicts = stragglers(self.judged, self.params)
        for rank in sorted(verdicts.keys() - self.flagged.keys()):
            v = verdicts[rank]
            self.log.emit(self._event(ev.Straggler, v), f"straggler: {v.describe(self.hosts.get(rank, ''))}")
        for rank in sorted(self.flagged.keys() - verdicts.keys()):
            v = self.flagged[rank]
            self.log.emit(
                self._event(ev.StragglerCleared, v),
                f"rank {rank}{self._on(rank)} is no straggler any more (flagged {v.kind} since step {v.since_step})",
            )
        if verdicts != self.flagged:
            self.flagged = verdicts
            self.publish(stragglers=tuple(self.note(v) for _, v in sorted(verdicts.items())))

    def gather(self, local: list[Heartbeat], now: float) -> dict[int, list[StepTime]]:
        """Each rank's step timings from its newest fresh beat: this node's own (fresher than its
        summary), the other nodes' summaries."""
        snaps = [HeartbeatSnapshot(b.rank, "", b) for b in local]
        for node, path in summary_paths(self.root):
            if node == self.node:
                continue
            try:
                snaps += read_summary(path).snapshots()
            except (OSError, ValueError):
                continue  # `status` and the node's own watchdog report a summary that cannot be read
        oldest = now - FRESH_INTERVALS * self.interval_s - FRESH_MARGIN_S
        series: dict[int, list[StepTime]] = {}
        for s in newest_per_rank(snaps):
            hb = s.heartbeat
            if hb is None or hb.phase != Phase.TRAIN or hb.wall_time < oldest or not hb.step_times:
                continue
            series[hb.rank] = list(hb.step_times)
            self.hosts[hb.rank] = hb.host
        return series

    def note(self, v: Verdict) -> StragglerNote:
        """A verdict as node 0's summary carries it, for `status`."""
        host = self.hosts.get(v.rank, "")
        return StragglerNote(
            v.rank, host, v.kind.value, round(v.value, 3), v.since_step, v.step, v.describe(host)
        )

    def _on(self, rank: int) -> str:
        host = self.hosts.get(rank, "")
        return f" on {host}" if host else ""

    def _event(self, cls: type[ev.Straggler | ev.StragglerCleared], v: Verdict) -> ev.Event:
        host = self.hosts.get(v.rank, "")
        return cls(v.rank, host, v.kind.value, round(v.value, 3), v.since_step, v.step)

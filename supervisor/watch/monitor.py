"""Watching one running launch until it ends: its exit, a stop signal, a dead rank, a hang. Each
poll reads the launch's heartbeats, hands them to the pure detectors (detectors.py), reports save
news, forwards a preemption notice to the ranks, and lets the loop act on the beats (the recovery
breakdown, the standby). Returns how the launch ended (``Ended``); the loop classifies it."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog
from supervisor.format.heartbeat import (
    Heartbeat,
    HeartbeatSnapshot,
    Phase,
    read_heartbeat,
    read_heartbeat_folder,
)
from supervisor.format.layout import RunDir, heartbeat_filename
from supervisor.watch import detectors, process, rootcause
from supervisor.watch.config import WatchConfig
from supervisor.watch.detectors import Hang
from supervisor.watch.hangs import Hangs
from supervisor.watch.signals import Signals

SIGNAL_POLL_S = 0.05
# A rank died: its peers cannot progress (and may ignore SIGTERM inside a collective), and nothing
# they write can be committed without it, so the rest of the launch gets SIGKILL at once.
DEAD_RANK_KILL_GRACE_S = 0.0
# Every local rank vanished without an exit code: the launched command's exit code says whether
# they finished (torchrun took 1.2-1.9 s to exit after its last worker here); this long at most.
ALL_RANKS_GONE_WAIT_S = 30.0
FULL_SCAN_S = 10.0

OnBeats = Callable[[process.Child, list[Heartbeat]], None]


@dataclass
class Ended:
    """How one launch ended, as the monitor saw it."""

    returncode: int
    hangs: list[Hang] = field(default_factory=list)
    dead: list[detectors.DeadRank] = field(default_factory=list)
    stop_signal: int | None = None
    preempted: bool = False
    culprit: str = ""  # who hung it, from the stack dumps (culprit.py)
    detected: float = 0.0  # when the monitor saw it end (a dead rank, a hang, the command's exit)


class Monitor:
    def __init__(
        self, cfg: WatchConfig, log: EventLog, hb_dir: Path, host: str, signals: Signals, hangs: Hangs
    ) -> None:
        self.cfg, self.log, self.hb_dir, self.host = cfg, log, hb_dir, host
        self.signals, self.hangs = signals, hangs

    def watch(self, child: process.Child, launch_id: str, on_beats: OnBeats) -> Ended:
        ended = Ended(returncode=0)
        reader = LaunchBeats(self.hb_dir, launch_id)
        next_check = time.monotonic() + self.cfg.poll_s
        gone: list[detectors.DeadRank] = []  # ranks seen vanished without an exit code, not yet dead
        gone_since: dict[int, float] = {}
        save_seen: dict[int, int] = {}
        while True:
            rc = child.poll()
            if rc is not None:
                ended.detected = time.time()
                # The ranks' last word (a save that worked again just before the end) is logged too.
                last = detectors.launch_heartbeats(reader.read(), launch_id)
                self._report_saves(last, save_seen)
                ended.returncode = rc
                if rc != 0:
                    ended.dead, ended.hangs = self._failed_end(child, last, gone, gone_since, ended.detected)
                return ended
            if self.signals.stop is not None:
                return self._stopped(child, ended, self.signals.stop)
            if self.signals.preempt_pending:
                ended.preempted = True
                self.signals.preempt_pending = not self._forward_preemption(child, launch_id)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.cfg.poll_s
                snaps = reader.read()
                beats = detectors.launch_heartbeats(snaps, launch_id)
                save_seen = self._report_saves(beats, save_seen)
                on_beats(child, beats)
                tree = set(child.tree())  # after the read: a rank that beat and then died is gone
                gone = detectors.dead_ranks(beats, self.host, tree)
                survivors = any(b.host == self.host and b.pid in tree for b in beats)
                dead, gone_since = detectors.confirm_dead(
                    gone,
                    gone_since,
                    time.monotonic(),
                    survivors=survivors,
                    grace_s=self.cfg.dead_rank_grace_s,
                    all_gone_wait_s=ALL_RANKS_GONE_WAIT_S,
                    failed=self._errored(launch_id, beats) if gone else (),
                )
                if dead and child.poll() is None:
                    return self._rank_died(child, ended, dead)
                hangs, note, due = self._hangs_now(child, launch_id, snaps, beats, judging=bool(gone))
                next_check = min(next_check, time.monotonic() + due)
                if hangs:
                    ended.detected = time.time()
                    ended.hangs = hangs = self.hangs.where_blocked(child, hangs)
                    ended.culprit = self.hangs.handle(child, hangs, launch_id, ended.detected, note)
                    ended.returncode = child.returncode()
                    return ended
            time.sleep(SIGNAL_POLL_S)

    def _hangs_now(
        self,
        child: process.Child,
        launch_id: str,
        snaps: list[HeartbeatSnapshot],
        beats: list[Heartbeat],
        judging: bool,
    ) -> tuple[list[Hang], str, float]:
        """The hung ranks now, what the ranks that gave up said, and the seconds until the next
        check. While a vanished rank is being judged (``judging``: dead, or a clean exit), no rank
        is hung: neither a silent one nor one that gave up waiting for its peers (it waited for
        that one). Else a rank that gave up waiting for its peers (exit 76) hangs the launch at
        once. Either is judged when due (the grace, a timeout), not a poll interval later."""
        if judging:
            return [], "", SIGNAL_POLL_S
        hangs, note = self.hangs.gave_up(beats)
        if hangs:
            return hangs, note, SIGNAL_POLL_S
        hangs, due = self.hangs.check(child, launch_id, snaps, beats)
        return hangs, "", due

    def _failed_end(
        self,
        child: process.Child,
        last: list[Heartbeat],
        gone: list[detectors.DeadRank],
        gone_since: dict[int, float],
        detected: float,
    ) -> tuple[list[detectors.DeadRank], list[Hang]]:
        """The dead and the hung of a launch whose command exited non-zero: the ranks seen vanished
        did not exit cleanly after all (the first to vanish first); a rank that gave up on a dead
        one: its death is the news, else a hang. A launcher that exits as soon as a rank is killed
        (torchrun, one rank on the node) may do so between two looks: its ranks gone without an
        exit code are the dead then, or the first failure of a multi-node launch would be pinned
        on a peer whose rank died of this one a moment later (its root cause dated, this one not)."""
        if gone:
            return sorted(gone, key=lambda d: (gone_since.get(d.rank, 0.0), d.rank)), []
        hangs = self.hangs.after_the_end(last, detected)
        if hangs:
            return [], hangs
        return detectors.dead_ranks(last, self.host, set(child.tree())), []

    def _stopped(self, child: process.Child, ended: Ended, signum: int) -> Ended:
        ended.stop_signal = signum
        grace = self.cfg.stop_grace_s or self.cfg.kill_grace_s
        self.log.emit(
            ev.Stop(), f"received {signal.Signals(signum).name}: stopping the child (grace {grace:g}s)"
        )
        self.log.emit(ev.Kill(unreaped=child.unreaped), child.kill(grace))
        ended.returncode = child.returncode()
        return ended

    def _rank_died(self, child: process.Child, ended: Ended, dead: list[detectors.DeadRank]) -> Ended:
        ended.dead, ended.detected = dead, time.time()
        self.log.emit(
            ev.RankDied(ranks=[d.rank for d in dead]),
            "; ".join(d.reason for d in dead) + ": killing the rest of the launch",
        )
        self.log.emit(ev.Kill(unreaped=child.unreaped), child.kill(DEAD_RANK_KILL_GRACE_S))
        ended.returncode = child.returncode()
        return ended

    def _errored(self, launch_id: str, beats: list[Heartbeat]) -> set[int]:
        """This host's ranks that recorded the exception that ended them (their last heartbeat,
        torchelastic's error file): no clean exit."""
        local = rootcause.errored_local_ranks(RunDir.of(self.cfg.root).elastic_logs(launch_id))
        return {b.rank for b in beats if b.host == self.host and (b.died_of or b.local_rank in local)}

    def _report_saves(self, beats: list[Heartbeat], seen: dict[int, int]) -> dict[int, int]:
        """save_failed / save_recovered events for what this node's ranks report."""
        news, seen = detectors.save_news((b for b in beats if b.host == self.host), seen)
        for n in news:
            self.log.emit(n.event, n.msg)
        return seen

    def _forward_preemption(self, child: process.Child, launch_id: str) -> bool:
        """Send the notice (SIGUSR1 unless --notice-signal) to this launch's ranks on this host;
        True once delivered. Ranks still in startup may not handle it yet (its default action
        kills), so the notice waits for them; a command that writes no heartbeat gets it, after
        --preempt-fallback seconds, on its ranks (process.Child.workers: never torchrun's agent,
        which SIGUSR1 would kill, nor a rank's DataLoader workers)."""
        beats = detectors.launch_heartbeats(read_heartbeat_folder(self.hb_dir), launch_id)
        tree = set(child.tree())
        local = [b for b in beats if b.host == self.host and b.pid in tree]
        if any(b.phase == Phase.STARTUP for b in local):
            return False
        if local:
            pids = [b.pid for b in local]
            who = f"ranks {sorted(b.rank for b in local)}"
        elif time.monotonic() - child.started_mono >= self.cfg.preempt_fallback_s:
            pids = child.workers()
            who = f"pids {pids} (this launch wrote no heartbeat)"
        else:
            return False
        process.send(pids, self.cfg.notice_signal)
        name = signal.Signals(self.cfg.notice_signal).name
        self.log.emit(ev.Preempt(pids=pids), f"preemption notice ({name}) forwarded to {who}")
        return True


class LaunchBeats:
    """Reads this launch's heartbeats: every file while its ranks are still assembling (the first
    FULL_SCAN_S, or while one is in startup or load), then only theirs, with a full rescan every
    FULL_SCAN_S. Thousands of ranks in a shared folder (no node-local one), polled by every node's
    watchdog twice a second, would otherwise be millions of reads a second."""

    def __init__(self, folder: Path, launch_id: str) -> None:
        self.folder = folder
        self.launch_id = launch_id
        self.started = time.monotonic()
        self.next_full = self.started + FULL_SCAN_S
        self.ranks: list[int] = []
        self.assembling = True

    def read(self) -> list[HeartbeatSnapshot]:
        now = time.monotonic()
        full = self.assembling or now >= self.next_full
        if full:
            snaps = read_heartbeat_folder(self.folder)
        else:
            snaps = [read_heartbeat(self.folder / heartbeat_filename(r), r) for r in self.ranks]
        if now >= self.next_full:
            self.next_full = now + FULL_SCAN_S
        beats = detectors.launch_heartbeats(snaps, self.launch_id)
        if full:
            self.ranks = [b.rank for b in beats]
        self.assembling = (
            now - self.started < FULL_SCAN_S
            or not beats
            or any(b.phase in (Phase.STARTUP, Phase.LOAD) for b in beats)
        )
        return snaps

"""A launch's hangs: found by the pure detectors (phase timeouts, learned train timeout), then,
before the kill, diagnosed: the file syscall /proc shows a hung rank blocked in, every local rank's
stacks (dumped by SIGUSR2), and the culprit named from where each rank waits (culprit.py)."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase, boot_id, read_heartbeat_folder
from supervisor.format.layout import stack_dump_filename
from supervisor.watch import culprit, detectors, liveness, process
from supervisor.watch.config import WatchConfig
from supervisor.watch.detectors import Hang

# A check scheduled for when a silent rank's timeout runs out runs this much after it: its silence
# is then over the timeout, not equal to it.
HANG_DUE_SLACK_S = 0.01


class Hangs:
    def __init__(self, cfg: WatchConfig, log: EventLog, hb_dir: Path, host: str) -> None:
        self.cfg, self.log, self.hb_dir, self.host = cfg, log, hb_dir, host
        self.step_times: list[float] = []  # the longest train step seen (--learn-timeout)

    def check(
        self, child: process.Child, launch_id: str, snaps: list[HeartbeatSnapshot], beats: list[Heartbeat]
    ) -> tuple[list[Hang], float]:
        """The hung ranks of this launch, and the seconds until a check should next find one."""
        timeouts = self.cfg.timeouts
        if self.cfg.learn_factor is not None:
            self.step_times.extend(
                b.last_step_s for b in beats if b.phase == Phase.TRAIN and b.last_step_s > 0
            )
            self.step_times = [max(self.step_times)] if self.step_times else []
            learned = liveness.learned_train_timeout(
                self.step_times, self.cfg.learn_factor, self.cfg.learn_floor_s
            )
            timeouts = liveness.effective_timeouts(timeouts, learned)
        clock = _clock()
        hangs = detectors.detect_hangs(
            snaps,
            launch_id=launch_id,
            launch_age_s=time.monotonic() - child.started_mono,
            clock=clock,
            timeouts=timeouts,
            require_heartbeat=self.cfg.require_heartbeat,
        )
        due = detectors.hang_due_s(beats, clock, timeouts)
        return hangs, math.inf if due is None else max(due, 0.0) + HANG_DUE_SLACK_S

    def gave_up(self, beats: list[Heartbeat]) -> tuple[list[Hang], str]:
        """A rank that gave up waiting for its peers in a save (exit 76) hangs the launch at once:
        the ranks it waited for, and what the ranks that gave up said (``detectors.gave_up``)."""
        return detectors.gave_up(beats, _clock(), self.cfg.timeouts)

    def after_the_end(self, beats: list[Heartbeat], detected: float) -> list[Hang]:
        """A rank gave up on its peers and the launch ended before a look: a hang all the same,
        logged without stack dumps (nothing is left to dump)."""
        hangs, note = self.gave_up(beats)
        if hangs:
            self.log.emit(
                ev.Hang(ranks=[h.rank for h in hangs], detected=round(detected, 3)),
                f"{note}; " + "; ".join(h.reason for h in hangs) + "; the launch had ended: no stack dumps",
            )
        return hangs

    def where_blocked(self, child: process.Child, hangs: list[Hang]) -> list[Hang]:
        """Each hung rank with the file syscall /proc shows it blocked in (a read that never
        returns writes no heartbeat and no stack dump: this names its path)."""
        tree = set(child.tree())
        out = []
        for h in hangs:
            where = process.where_blocked(h.pid) if h.pid in tree else ""
            if where:
                h = replace(h, blocked=where)
                self.log.emit(
                    ev.BlockedIo(rank=h.rank, pid=h.pid, phase=h.label, io_path=h.io_path, blocked=where),
                    f"rank {h.rank} (pid {h.pid}) is blocked in {where}",
                )
            out.append(h)
        return out

    def handle(
        self, child: process.Child, hangs: list[Hang], launch_id: str, detected: float, note: str = ""
    ) -> str:
        """Dump every local rank's stacks, name the culprit from where each rank waits, log it with
        the dumps (``note`` first: what ranks that gave up waiting said), then kill the launch.
        Returns who hung it, for the launch's reason."""
        beats = detectors.launch_heartbeats(read_heartbeat_folder(self.hb_dir), launch_id)  # every rank
        tree = set(child.tree())
        stopped = set(process.stopped(tree))
        targets = {b.rank: b.pid for b in beats if b.host == self.host and b.pid in tree}
        procs = {r: process.proc_state(pid) for r, pid in targets.items()}  # before SIGCONT
        paths = {r: self.hb_dir / stack_dump_filename(r) for r in targets}
        dumps = process.dump_stacks(targets, paths, self.cfg.dump_wait_s)
        diag = culprit.diagnose(culprit.Probe(r, pid, *procs[r], dumps.get(r)) for r, pid in targets.items())
        who = diag.summary()
        self.log.emit(
            ev.Hang(
                ranks=[h.rank for h in hangs],
                stopped_ranks=sorted(r for r, pid in targets.items() if pid in stopped),
                stopped_pids=sorted(stopped),
                detected=round(detected, 3),
                culprits=[f.to_dict() for f in diag.culprits],
                suspects=[f.to_dict() for f in diag.suspects],
                waiting_ranks=diag.waiting,
            ),
            (f"{note}; " if note else "") + "; ".join(h.reason for h in hangs) + (f"; {who}" if who else ""),
        )
        for rank, pid in sorted(targets.items()):
            text = dumps.get(rank)
            msg = f"stack dump of rank {rank} (pid {pid}), from {paths[rank]}"
            if text is None:
                msg = f"rank {rank} (pid {pid}) wrote no stack dump within {self.cfg.dump_wait_s:g}s"
            self.log.emit(ev.StackDump(rank=rank, pid=pid, path=str(paths[rank]), stacks=text), msg)
        note = child.kill(self.cfg.kill_grace_s)
        self.log.emit(
            ev.Kill(sigkilled=child.sigkilled, unreaped=child.unreaped), f"hung launch killed: {note}"
        )
        return "; ".join(f"culprit {f.describe()}" for f in diag.culprits) or who


def _clock() -> liveness.Clock:
    return liveness.Clock(time.time(), time.monotonic(), boot_id())

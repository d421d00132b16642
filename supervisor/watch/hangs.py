"""A launch's hangs: found by the pure detectors (phase timeouts, learned train timeout), then,
before the kill, diagnosed: the file syscall /proc shows a hung rank blocked in, every local rank's
collectives (torch's flight recorder, asked through the library: collectives.py) and stacks
(dumped by SIGUSR2), the stuck collective and the rank that never entered it, else the culprit
named from where each rank waits (culprit.py); when every rank came and none finished, the
connections the network does not deliver (network.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format.collectives import CollectiveDump
from supervisor.format.events import EventLog
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase, boot_id, read_heartbeat_folder
from supervisor.format.layout import stack_dump_filename
from supervisor.watch import collectives, culprit, detectors, liveness, network, process
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
        """Dump every local rank's stacks and ask it what its flight recorder saw of its collectives,
        name the stuck collective and the culprit (the rank that never entered it, else where each
        rank waits), log it with the dumps (``note`` first: what ranks that gave up waiting said),
        then kill the launch. Returns who hung it, for the launch's reason."""
        beats = detectors.launch_heartbeats(read_heartbeat_folder(self.hb_dir), launch_id)  # every rank
        tree = set(child.tree())
        stopped = set(process.stopped(tree))
        targets = {b.rank: b.pid for b in beats if b.host == self.host and b.pid in tree}
        procs = {r: process.proc_state(pid) for r, pid in targets.items()}  # before SIGCONT
        paths = {r: self.hb_dir / stack_dump_filename(r) for r in targets}
        token = f"{launch_id}.{time.time_ns()}"
        dumps, unasked, answers = dump_then_ask(self.hb_dir, targets, paths, self.cfg.dump_wait_s, token)
        stuck = next(iter(collectives.find_stuck(answers)), None)
        diag = culprit.diagnose(
            (culprit.Probe(r, pid, *procs[r], dumps.get(r)) for r, pid in targets.items()),
            stuck.culprits if stuck else (),
        )
        world = max((b.world_size for b in beats), default=len(targets))
        steps = {b.rank: b.step for b in beats} | {r: a.step for r, a in answers.items() if a.step >= 0}
        line = stuck.describe(steps, len(targets), world) if stuck else ""
        net = network.undelivered(targets) if stuck is not None and not stuck.culprits else []
        line += "".join(f"; {n.describe()}" for n in net)
        who = diag.summary(line)
        self.log.emit(
            ev.Hang(
                ranks=[h.rank for h in hangs],
                stopped_ranks=sorted(r for r, pid in targets.items() if pid in stopped),
                stopped_pids=sorted(stopped),
                detected=round(detected, 3),
                culprits=[f.to_dict() for f in diag.culprits],
                suspects=[f.to_dict() for f in diag.suspects],
                waiting_ranks=diag.waiting,
                collective=stuck.to_dict() if stuck else None,
                collectives=_answers(targets, unasked, answers, self.cfg.dump_wait_s),
                network=[n.to_dict() for n in net],
                late_s=round(
                    max((h.silent_s - h.timeout_s for h in hangs if h.rank is not None), default=0.0), 3
                ),
                stuck_s=round(detected - stuck.entered_t, 3) if stuck and stuck.entered_t else None,
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
        blame = "; ".join(f"culprit {f.describe()}" for f in diag.culprits)
        return "; ".join(p for p in (line, blame) if p) or who


def dump_then_ask(
    folder: Path, targets: Mapping[int, int], paths: Mapping[int, Path], wait_s: float, token: str
) -> tuple[dict[int, str], dict[int, str], dict[int, CollectiveDump]]:
    """Each rank's stack dump (``targets``: rank -> pid; returns rank -> its text), then each rank's
    collectives (rank -> why it could not be asked; rank -> its answer); ``wait_s`` bounds each wait.
    In this order: faulthandler walks every thread's frames from a signal handler, without the GIL,
    and a reporter thread woken by the question at the same moment runs Python under that walk (a
    drill on a loaded node: the rank died of it, its dump cut mid-line, answering nothing)."""
    dumps = process.dump_stacks(targets, paths, wait_s)  # and SIGCONT: a stopped rank answers too
    unasked = collectives.request(folder, targets, token)
    answers = collectives.collect(folder, set(targets) - set(unasked), token, time.monotonic() + wait_s)
    return dumps, unasked, answers


def _answers(
    targets: Mapping[int, int],
    unasked: Mapping[int, str],
    answers: Mapping[int, CollectiveDump],
    wait_s: float,
) -> dict[str, str]:
    """Each local rank's collectives in flight, or why it said nothing (for the hang event)."""
    out = {}
    for r in sorted(targets):
        if r in unasked:
            out[str(r)] = unasked[r]
        elif (a := answers.get(r)) is None:
            out[str(r)] = f"no answer within {wait_s:g}s"
        else:
            out[str(r)] = a.problem or collectives.pending_line(a.groups)
    return out


def _clock() -> liveness.Clock:
    return liveness.Clock(time.time(), time.monotonic(), boot_id())

"""The watchdog loop: pick -> launch -> monitor heartbeats -> classify -> decide -> back off.

Facts are gathered here (processes, heartbeat files, the store) and handed to the pure functions
in ``policy.py``; this module only carries out what they decide and records it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from supervisor import culprit, events, launcher, policy, store
from supervisor.events import EventLog, RunState
from supervisor.exitcodes import Exit
from supervisor.fsutil import hostname
from supervisor.heartbeat import (
    ENV_LAUNCH_ID,
    ENV_RESTART_COUNT,
    Heartbeat,
    HeartbeatSnapshot,
    Phase,
    read_heartbeat,
    read_heartbeats,
)
from supervisor.layout import RunDir
from supervisor.policy import Hang, LaunchRecord, Outcome
from supervisor.watch_config import SHARE_STORE_ENV, WatchConfig

SIGNAL_POLL_S = 0.05
# A rank died: its peers cannot progress (and may ignore SIGTERM inside a collective), and nothing
# they write can be committed without it, so the rest of the launch gets SIGKILL at once.
DEAD_RANK_GRACE_S = 0.0
FULL_SCAN_S = 10.0
# A preemption notice waits this long for ranks' heartbeats before going to the whole tree.
PREEMPT_FALLBACK_S = 10.0


@dataclass
class _Ended:
    """How one launch ended, as the monitor saw it."""

    returncode: int
    hangs: list[Hang] = field(default_factory=list)
    dead: list[policy.DeadRank] = field(default_factory=list)
    stop_signal: int | None = None
    preempted: bool = False
    culprit: str = ""  # who hung it, from the stack dumps (culprit.py)


class Watchdog:
    def __init__(self, cfg: WatchConfig) -> None:
        self.cfg = cfg
        self.host = hostname()
        self.log = EventLog(cfg.root, cfg.node)
        self.stop_signal: int | None = None
        self.preempt_pending = False
        self.step_times: list[float] = []
        self.state = self._initial_state()

    # ------------------------------------------------------------ state

    def _initial_state(self) -> RunState:
        path = events.state_path(self.cfg.root, self.cfg.node)
        try:
            prev = events.read_state(path)
        except ValueError as e:
            self.log.emit("state_unreadable", f"{e}; starting with a fresh budget (the old file is kept)")
            os.replace(path, path.with_suffix(".json.bad"))
            prev = None
        base = RunState(
            node=self.cfg.node,
            host=self.host,
            watchdog_pid=os.getpid(),
            command=self.cfg.command,
            timeouts=self.cfg.timeouts.to_dict(),
            started=time.time(),
        )
        if prev is None or self.cfg.reset_budget:
            return base
        return replace(
            base, restart_times=prev.restart_times, launches=prev.launches, launch_count=prev.launch_count
        )

    def _save(self, **changes: object) -> None:
        self.state = replace(self.state, **changes)  # type: ignore[arg-type]
        events.write_state(self.cfg.root, self.state)

    # ------------------------------------------------------------ signals

    def _install_signals(self) -> None:
        def stop(signum: int, _frame: object) -> None:
            if self.stop_signal is None:
                self.stop_signal = signum

        def preempt(_signum: int, _frame: object) -> None:
            self.preempt_pending = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGUSR1, preempt)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        self.cfg.root.mkdir(parents=True, exist_ok=True)
        self._install_signals()
        subreaper = launcher.become_subreaper()
        carried = len(self.state.restart_times)
        self.log.emit(
            "watchdog_start",
            f"watchdog pid {os.getpid()} on {self.host} node {self.cfg.node}: {' '.join(self.cfg.command)}"
            + (f" ({carried} earlier restarts count against the budget)" if carried else ""),
            pid=os.getpid(),
            command=list(self.cfg.command),
            restarts_carried=carried,
            subreaper=subreaper,
        )
        self._save(status=events.RESTARTING, reason="starting")
        while True:
            resumed_from, stop = self._pick()
            if self.stop_signal is not None:
                return self._finish(128 + self.stop_signal, events.STOPPED, "stopped before launch")
            if self.preempt_pending and self.cfg.policy.requeue_exit:
                why = "preemption notice before a launch: the newest checkpoint stands; requeue"
                return self._finish(Exit.REQUEUE_REQUESTED, events.REQUEUED, why)
            if stop is not None:
                return self._finish(Exit.CHILD_NONRETRYABLE, events.FAILED, stop)
            rec, ended = self._launch_once(resumed_from)
            history = self.state.launches
            now = time.time()
            d = policy.decide(
                rec,
                history,
                self.state.restart_times,
                now,
                self.cfg.policy,
                preempted=ended.preempted,
                stop_signal=ended.stop_signal,
            )
            restarts = (*self.state.restart_times, now) if d.counts_as_restart else self.state.restart_times
            self._save(restart_times=restarts)
            if not d.relaunch:
                status = {
                    Exit.OK: events.DONE,
                    Exit.REQUEUE_REQUESTED: events.REQUEUED,
                }.get(d.exit_code, events.STOPPED if ended.stop_signal else events.FAILED)
                return self._finish(d.exit_code, status, d.reason)
            self.log.emit("relaunch", d.reason, wait_s=round(d.wait_s, 3), restarts=len(restarts))
            self._save(status=events.RESTARTING, reason=d.reason, child_pid=None)
            if not self._sleep(d.wait_s):
                if self.stop_signal is None:  # a preemption notice with --requeue-exit
                    why = "preemption notice between launches: the newest checkpoint stands; requeue"
                    return self._finish(Exit.REQUEUE_REQUESTED, events.REQUEUED, why)
                return self._finish(128 + self.stop_signal, events.STOPPED, "stopped during backoff")

    def _finish(self, code: int, status: str, reason: str) -> int:
        self.log.emit("exit", f"watchdog exits {code}: {reason}", exit_code=code, status=status)
        self._save(status=status, reason=reason, exit_code=code, child_pid=None)
        return code

    def _sleep(self, seconds: float) -> bool:
        """Back off; False when a stop signal, or with --requeue-exit a preemption notice, arrived
        meanwhile (without --requeue-exit the notice waits for the next launch's ranks)."""
        deadline = time.monotonic() + seconds
        while True:
            if self.stop_signal is not None or (self.preempt_pending and self.cfg.policy.requeue_exit):
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(min(SIGNAL_POLL_S, max(0.0, deadline - time.monotonic())))

    def _pick(self) -> tuple[int | None, str | None]:
        """Step to resume from (None: from scratch); the second item is a reason to stop."""
        if self.cfg.remote:
            return self._pick_across_tiers()
        refs = store.list_checkpoints(self.cfg.root)
        if self.state.launch_count == 0 or not refs:
            return (refs[0].step if refs else None), None
        try:
            res = store.pick(self.cfg.root, deep=self.cfg.deep_verify, key=self.cfg.sign_key)
        except store.MismatchError as e:
            return None, f"checkpoint does not match this run: {e}"
        for name, why in res.quarantined:
            self.log.emit("quarantine", f"quarantined {name}: {why}", checkpoint=name, why=why)
        for name, why in res.untrusted:
            self.log.emit("untrusted", f"skipped {name}, not trusted: {why}", checkpoint=name, why=why)
        chosen = res.chosen.ref if res.chosen else None
        how = "deep" if self.cfg.deep_verify else "quick"
        msg = (
            f"resume from {chosen.name} ({how} check passed)"
            if chosen
            else "no valid checkpoint: start from scratch"
        )
        self.log.emit("pick", msg, checkpoint=chosen.name if chosen else None, verify=how)
        return (chosen.step if chosen else None), None

    def _pick_across_tiers(self) -> tuple[int | None, str | None]:
        """Before every launch, the first included (after node loss nothing is local): the newest
        valid checkpoint of either tier, downloaded when only the remote has it. An unreachable
        remote with nothing valid locally is waited for (backing off), never silently skipped."""
        from supervisor.tiers.remote import RemoteUnavailable, open_remote
        from supervisor.tiers.resume import prepare_resume

        how = "deep" if self.cfg.deep_verify else "quick"
        deadline = time.monotonic() + self.cfg.remote_wait_s
        wait = self.cfg.policy.backoff.initial_s or 1.0
        while True:
            try:
                key = self.cfg.sign_key
                remote = open_remote(self.cfg.remote, self.cfg.remote_endpoint, key=key)
                res = prepare_resume(
                    self.cfg.root, remote, deep=self.cfg.deep_verify, on_event=self.log.emit, key=key
                )
            except store.MismatchError as e:
                return None, f"checkpoint does not match this run: {e}"
            except RemoteUnavailable as e:
                # Every failed attempt is logged, the last one too: a slow refusal (client retries)
                # can use up the whole wait in one attempt.
                giving_up = time.monotonic() >= deadline
                then = "giving up" if giving_up else f"retrying in {wait:.0f}s"
                self.log.emit("remote_unavailable", f"{e}; nothing valid locally: {then}")
                if giving_up:
                    return (
                        None,
                        f"remote {self.cfg.remote} unreachable for {self.cfg.remote_wait_s:.0f}s and no valid local checkpoint: {e}",
                    )
                if not self._sleep(wait):
                    return None, None  # a stop signal or a preemption notice: run() decides
                wait = min(wait * 2, self.cfg.policy.backoff.max_s)
                continue
            chosen = res.chosen
            msg = (
                f"resume from {chosen.name} ({res.source}, {how} check passed)"
                if chosen
                else "no valid checkpoint on either tier: start from scratch"
            )
            self.log.emit(
                "pick", msg, checkpoint=chosen.name if chosen else None, verify=how, source=res.source
            )
            return (chosen.step if chosen else None), None

    def _launch_once(self, resumed_from: int | None) -> tuple[LaunchRecord, _Ended]:
        number = self.state.launch_count + 1
        launch_id = f"{self.host}-n{self.cfg.node}-{os.getpid()}-{number}-{uuid.uuid4().hex[:6]}"
        env = dict(os.environ)
        env[ENV_LAUNCH_ID] = launch_id
        env[ENV_RESTART_COUNT] = str(number - 1)
        if self.cfg.share_store_fix:
            env.setdefault(SHARE_STORE_ENV, "1")
        child = launcher.Child(list(self.cfg.command), env)
        self._save(
            status=events.RUNNING,
            reason=f"launch {number} running",
            launch_count=number,
            launch_id=launch_id,
            child_pid=child.pid,
            launch_started=child.started,
            exit_code=None,
        )
        self.log.emit(
            "launch",
            f"launch {number} (id {launch_id}) pid {child.pid}, resuming from "
            + ("scratch" if resumed_from is None else f"step {resumed_from}"),
            launch=number,
            launch_id=launch_id,
            pid=child.pid,
            resumed_from=resumed_from,
        )
        ended = self._monitor(child, launch_id)
        child.finish()
        beats = policy.launch_heartbeats(read_heartbeats(self.cfg.root), launch_id)
        cls = self._classify(ended, beats)
        refs = store.list_checkpoints(self.cfg.root)
        rec = LaunchRecord(
            number=number,
            launch_id=launch_id,
            started=child.started,
            ended=time.time(),
            outcome=cls.outcome,
            reason=cls.reason,
            resumed_from=resumed_from,
            newest_after=refs[0].step if refs else None,
            last_step=died_at(beats),
        )
        self.log.emit(
            "launch_end",
            f"launch {number} ended after {rec.ended - rec.started:.1f}s "
            f"{policy.where_died(rec.last_step)}: {cls.reason}",
            launch=number,
            launch_id=launch_id,
            outcome=cls.outcome.value,
            returncode=ended.returncode,
            rank_exit_codes={b.rank: b.exit_code for b in beats if b.exit_code is not None},
            last_step=rec.last_step,
            newest_checkpoint=rec.newest_after,
        )
        self._save(launches=self.state.with_launch(rec).launches)
        return rec, ended

    def _classify(self, ended: _Ended, beats: list[Heartbeat]) -> policy.Classification:
        """A rank's deliberate exit code (non-retryable, requeue) wins: the deaths and hangs of
        the others may just be the fallout of it."""
        cls = policy.classify_exit(ended.returncode, (b.exit_code for b in beats))
        if cls.outcome in (Outcome.NON_RETRYABLE, Outcome.REQUEUE, Outcome.DONE):
            return cls
        if ended.stop_signal is not None:
            name = signal.Signals(ended.stop_signal).name
            return policy.Classification(
                Outcome.STOPPED, ended.returncode, f"stopped by {name} ({cls.reason})"
            )
        if ended.dead:
            more = f" (+{len(ended.dead) - 1} more ranks)" if len(ended.dead) > 1 else ""
            return policy.Classification(Outcome.CRASH, ended.returncode, f"{ended.dead[0].reason}{more}")
        if ended.hangs:
            h = ended.hangs[0]
            more = f" (+{len(ended.hangs) - 1} more ranks)" if len(ended.hangs) > 1 else ""
            who = f"; {ended.culprit}" if ended.culprit else ""
            return policy.Classification(Outcome.HANG, ended.returncode, f"hang: {h.reason}{more}{who}")
        return cls

    # ------------------------------------------------------------ monitoring one launch

    def _monitor(self, child: launcher.Child, launch_id: str) -> _Ended:
        ended = _Ended(returncode=0)
        reader = _LaunchBeats(self.cfg.root, launch_id)
        next_check = time.monotonic() + self.cfg.poll_s
        while True:
            rc = child.poll()
            if rc is not None:
                ended.returncode = rc
                return ended
            if self.stop_signal is not None and ended.stop_signal is None:
                ended.stop_signal = self.stop_signal
                name = signal.Signals(self.stop_signal).name
                self.log.emit(
                    "stop", f"received {name}: stopping the child (grace {self.cfg.kill_grace_s:g}s)"
                )
                note = child.kill(self.cfg.kill_grace_s)
                self.log.emit("kill", note)
                continue
            if self.preempt_pending:
                ended.preempted = True
                self.preempt_pending = not self._forward_preemption(child, launch_id)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.cfg.poll_s
                snaps = reader.read()
                beats = policy.launch_heartbeats(snaps, launch_id)
                dead = policy.dead_ranks(beats, self.host, set(child.tree()))  # tree after the read
                if dead and child.poll() is None:
                    ended.dead = dead
                    self.log.emit(
                        "rank_died",
                        "; ".join(d.reason for d in dead) + ": killing the rest of the launch",
                        ranks=[d.rank for d in dead],
                    )
                    self.log.emit("kill", child.kill(DEAD_RANK_GRACE_S))
                    ended.returncode = child.poll() or 0
                    return ended
                hangs = self._check_hangs(child, launch_id, snaps, beats)
                if hangs:
                    ended.hangs = hangs
                    ended.culprit = self._handle_hang(child, hangs, launch_id)
                    ended.returncode = child.poll() or 0
                    return ended
            time.sleep(SIGNAL_POLL_S)

    def _forward_preemption(self, child: launcher.Child, launch_id: str) -> bool:
        """Send SIGUSR1 to this launch's ranks on this host; True once delivered. Ranks still in
        startup may not handle it yet (its default action kills), so the notice waits for them;
        a command that writes no heartbeat gets it, after PREEMPT_FALLBACK_S, on the processes
        under the launched one (never torchrun's agent, which SIGUSR1 would kill)."""
        beats = policy.launch_heartbeats(read_heartbeats(self.cfg.root), launch_id)
        tree = set(child.tree())
        local = [b for b in beats if b.host == self.host and b.pid in tree]
        if any(b.phase == Phase.STARTUP for b in local):
            return False
        if local:
            pids = [b.pid for b in local]
            who = f"ranks {sorted(b.rank for b in local)}"
        elif time.time() - child.started >= PREEMPT_FALLBACK_S:
            pids = child.workers()
            who = f"pids {pids} (this launch wrote no heartbeat)"
        else:
            return False
        launcher.send(pids, signal.SIGUSR1)
        self.log.emit("preempt", f"preemption notice (SIGUSR1) forwarded to {who}", pids=pids)
        return True

    def _check_hangs(
        self, child: launcher.Child, launch_id: str, snaps: list[HeartbeatSnapshot], beats: list[Heartbeat]
    ) -> list[Hang]:
        timeouts = self.cfg.timeouts
        if self.cfg.learn_factor is not None:
            self.step_times.extend(
                b.last_step_s for b in beats if b.phase == Phase.TRAIN and b.last_step_s > 0
            )
            self.step_times = [max(self.step_times)] if self.step_times else []
            learned = policy.learned_train_timeout(
                self.step_times, self.cfg.learn_factor, self.cfg.learn_floor_s
            )
            timeouts = policy.effective_timeouts(timeouts, learned)
        return policy.detect_hangs(
            snaps, launch_id=launch_id, launch_started=child.started, now=time.time(), timeouts=timeouts
        )

    def _handle_hang(self, child: launcher.Child, hangs: list[Hang], launch_id: str) -> str:
        """Dump every local rank's stacks, name the culprit from where each rank waits (culprit.py),
        log it with the dumps, then kill the launch. Returns who hung it, for the launch's reason."""
        beats = policy.launch_heartbeats(read_heartbeats(self.cfg.root), launch_id)  # every rank
        tree = set(child.tree())
        stopped = set(launcher.stopped(tree))
        targets = {b.rank: b.pid for b in beats if b.host == self.host and b.pid in tree}
        procs = {r: launcher.proc_state(pid) for r, pid in targets.items()}  # before SIGCONT
        run = RunDir.of(self.cfg.root)
        paths = {r: run.stack_dump(r) for r in targets}
        dumps = launcher.dump_stacks(targets, paths, self.cfg.dump_wait_s)
        diag = culprit.diagnose(culprit.Probe(r, pid, *procs[r], dumps.get(r)) for r, pid in targets.items())
        who = diag.summary()
        self.log.emit(
            "hang",
            "; ".join(h.reason for h in hangs) + (f"; {who}" if who else ""),
            ranks=[h.rank for h in hangs],
            stopped_ranks=sorted(r for r, pid in targets.items() if pid in stopped),
            stopped_pids=sorted(stopped),
            **diag.fields(),
        )
        for rank, pid in sorted(targets.items()):
            text = dumps.get(rank)
            msg = f"stack dump of rank {rank} (pid {pid}), from {paths[rank]}"
            if text is None:
                msg = f"rank {rank} (pid {pid}) wrote no stack dump within {self.cfg.dump_wait_s:g}s"
            self.log.emit("stack_dump", msg, rank=rank, pid=pid, path=str(paths[rank]), stacks=text)
        note = child.kill(self.cfg.kill_grace_s)
        self.log.emit("kill", f"hung launch killed: {note}", sigkilled=child.sigkilled)
        return "; ".join(f"culprit {f.describe()}" for f in diag.culprits) or who


class _LaunchBeats:
    """Reads this launch's heartbeats: every file while its ranks are still assembling (the first
    FULL_SCAN_S, or while one is in startup or load), then only theirs, with a full rescan every
    FULL_SCAN_S. Thousands of ranks on a shared filesystem, polled by every node's watchdog twice
    a second, would otherwise be millions of reads a second."""

    def __init__(self, root: Path, launch_id: str) -> None:
        self.run = RunDir.of(root)
        self.launch_id = launch_id
        self.started = time.monotonic()
        self.next_full = self.started + FULL_SCAN_S
        self.ranks: list[int] = []
        self.assembling = True

    def read(self) -> list[HeartbeatSnapshot]:
        now = time.monotonic()
        full = self.assembling or now >= self.next_full
        if full:
            snaps = read_heartbeats(self.run.root)
        else:
            snaps = [read_heartbeat(self.run.heartbeat(r), r) for r in self.ranks]
        if now >= self.next_full:
            self.next_full = now + FULL_SCAN_S
        beats = policy.launch_heartbeats(snaps, self.launch_id)
        if full:
            self.ranks = [b.rank for b in beats]
        self.assembling = (
            now - self.started < FULL_SCAN_S
            or not beats
            or any(b.phase in (Phase.STARTUP, Phase.LOAD) for b in beats)
        )
        return snaps


def died_at(beats: list[Heartbeat]) -> int | None:
    """The step a launch died at: the lowest step among its unfinished ranks (ranks move in
    lockstep, so the laggard is where the group stopped; the others may be one step ahead)."""
    running = [b.step for b in beats if b.phase != Phase.DONE]
    return min(running) if running else max((b.step for b in beats), default=None)


def watch(cfg: WatchConfig) -> int:
    return Watchdog(cfg).run()

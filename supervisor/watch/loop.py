"""The watchdog loop: pick -> launch -> monitor -> decide, then back off and again.

::

    while True:
        resumed_from = picker.pick()              # picker.py: the newest valid checkpoint
        child = standby.take() or start()         # standby.py (--standby)
        ended = monitor.watch(child)              # monitor.py: exit, stop, dead rank, hang (hangs.py)
        decision = restart_policy.decide(...)     # pure: stop with a verdict, or relaunch after a wait

The run's status moves as format/runstatus.py draws it (RESTARTING -> RUNNING -> RESTARTING ...
-> one of DONE, REQUEUED, STOPPED, FAILED), written to state.json by state_file.py. Facts are
gathered by the collaborators (processes, heartbeat files, the store) and handed to pure functions
(detectors.py, restart_policy.py); this module carries out what they decide and records it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from supervisor import store
from supervisor.format import confined, events
from supervisor.format import eventtypes as ev
from supervisor.format.atomic import hostname
from supervisor.format.collectives import recorder_env
from supervisor.format.events import EventLog, RunState
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import (
    ENV_LAUNCH_ID,
    ENV_PHASE_TIMEOUTS,
    ENV_RESTART_COUNT,
    ENV_STANDBY_RELEASE,
    ENV_WATCHDOG_PID,
    Heartbeat,
    Phase,
    read_heartbeat_folder,
)
from supervisor.format.launches import FAILURES, LaunchRecord, Outcome
from supervisor.format.layout import (
    ELASTIC_ERROR_FILE_ENV,
    HEARTBEAT_DIR_ENV,
    RunDir,
    launch_id,
    node_local_base,
)
from supervisor.format.roster import ENV_GROUP, RELEASED, GroupFacts
from supervisor.format.runstatus import RunStatus
from supervisor.store.ioerrors import StorageUnavailable, describe, retry_transient
from supervisor.watch import (
    detectors,
    launch_dirs,
    node_summary,
    oom,
    process,
    recovery,
    restart_policy,
    rootcause,
)
from supervisor.watch.buddy import Buddy
from supervisor.watch.config import ELASTIC_LOG_DIR_ENV, SHARE_STORE_ENV, WatchConfig
from supervisor.watch.hangs import Hangs
from supervisor.watch.memory import Memory
from supervisor.watch.metrics_file import MetricsFile
from supervisor.watch.monitor import SIGNAL_POLL_S, Ended, Monitor
from supervisor.watch.picker import Picker
from supervisor.watch.recovery import Moment
from supervisor.watch.roster import RosterFollower, Stopped
from supervisor.watch.signals import Signals
from supervisor.watch.standby import Standby
from supervisor.watch.state_file import StateFile
from supervisor.watch.stops import Interrupted, Stop
from supervisor.watch.straggler_watch import StragglerWatch
from supervisor.watch.stragglers import Params
from supervisor.watch.torchrun_cmd import restarts_inside

T = TypeVar("T")

# The command could not be started, and will not be on a retry: a usage error of COMMAND.
CANNOT_EXEC = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOEXEC})
# The status a final decision leaves the run in, by its exit code (else STOPPED or FAILED).
_FINAL_STATUS = {int(Exit.OK): RunStatus.DONE, int(Exit.REQUEUE_REQUESTED): RunStatus.REQUEUED}


class Watchdog:
    def __init__(self, cfg: WatchConfig) -> None:
        self.cfg = cfg
        self.host = hostname()
        self.log = EventLog(cfg.root, cfg.node)
        self.signals = Signals(cfg.notice_signal, cfg.policy.requeue_exit)
        # Processes a kill could not reap (state D on a hung mount): named once, then not waited for.
        self.abandoned: set[tuple[int, int]] = set()
        # The relaunch under way: the moments of its recovery so far (None: no failure to recover from).
        self.recovering: dict[Moment, float] | None = None
        # Where this node's ranks write their heartbeats (node-local, see _node_local), and the
        # thread that publishes them as the node's summary.
        self.hb_dir = RunDir.of(cfg.root).heartbeats
        self.publisher: node_summary.Publisher | None = None
        self.metrics: MetricsFile | None = None
        initial = RunState(
            node=cfg.node,
            host=self.host,
            watchdog_pid=os.getpid(),
            command=cfg.command,
            timeouts=cfg.timeouts.to_dict(),
            started=time.time(),
        )
        self.states = StateFile(initial, cfg.root, self.log, self._publish)
        self.picker = Picker(cfg, self.log, self._io, self._pick_retry, self._sleep)
        self.standby = Standby(cfg.root, self.host, self.log, lambda n: self._start_launch(n, standby=True))
        self.oom_kills: int | None = None  # the memory cgroup's OOM kills when the launch started
        self.memory = Memory(self.log)  # the memory tier's folder on this node (memory.py)
        self.buddy: Buddy | None = None  # its replica on the next node, and the previous one's here
        self.follower = (
            RosterFollower(cfg.root, cfg.roster, cfg.node, self.log, self._save, self._publish, self._poke)
            if cfg.roster
            else None
        )
        params = Params(cfg.straggler_factor, cfg.straggler_window, hold=cfg.straggler_hold)
        self.stragglers = StragglerWatch(
            cfg.root, cfg.node, self.log, params, cfg.summary_interval_s, self._publish
        )

    @property
    def state(self) -> RunState:
        return self.states.state

    def _save(self, status: RunStatus | None = None, **changes: object) -> None:
        self.states.save(status, **changes)

    # ------------------------------------------------------------ storage retries

    def _io(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` retried on transient storage errors for --io-retry (each retry in the events
        and the state), then StorageUnavailable: the watchdog exits 14."""
        return retry_transient(
            fn,
            deadline_s=self.cfg.io_retry_s,
            what=what,
            fix=lambda e: store.unreadable_fix(self.cfg.root, e.filename),
            on_retry=self._io_retry,
        )

    def _io_retry(self, msg: str) -> None:
        self.log.emit(ev.IoRetry(), msg)
        self._save(reason=f"storage trouble, retrying: {msg}")

    def _pick_retry(self, msg: str) -> None:
        """A retry of the pick; a stop signal (or a preemption notice with --requeue-exit) ends
        the retries, as it ends a backoff wait."""
        self._io_retry(msg)
        if self.signals.interrupted:
            raise Interrupted(msg)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """The loop, and its verdict on the storage: a transient error that outlasted --io-retry,
        or any other the watchdog met in the run directory, is exit 14 (requeue-able), never the
        usage code and never a traceback."""
        self.signals.install()
        try:
            return self._run()
        except Stop as e:
            return self._finish(e.code, RunStatus.FAILED, str(e))
        except StorageUnavailable as e:
            return self._finish(Exit.STORAGE_UNAVAILABLE, RunStatus.FAILED, str(e))
        except OSError as e:
            why = (
                f"{e.filename or self.cfg.root}: {describe(e)}: the watchdog cannot use the run directory; "
                "check the file system (mount, server, permissions, quota), then requeue"
            )
            return self._finish(Exit.STORAGE_UNAVAILABLE, RunStatus.FAILED, why)
        finally:
            self.standby.drop()
            if self.buddy is not None:
                self.buddy.close()
            self.memory.remove()
            if self.publisher is not None:
                self.publisher.stop()
            if self.metrics is not None:
                self.metrics.stop()

    def _run(self) -> int:
        monitor = self._start_up()
        while True:
            group = None
            if self.follower is not None:  # --roster: this node's turn, or stop
                turn = self.follower.turn(self.signals, self._keep_standby)
                if turn is None:
                    return self._interrupted("while waiting for the roster", "while waiting for the roster")
                if isinstance(turn, Stopped):  # DONE only after a launch: a spare not needed stops
                    status = RunStatus.STOPPED if turn.code == Exit.OK else RunStatus.FAILED
                    if turn.code == Exit.REQUEUE_REQUESTED:
                        status = RunStatus.REQUEUED
                    return self._finish(turn.code, status, turn.reason)
                group = turn
            resumed_from = self._pick()
            if self.signals.interrupted:
                return self._interrupted("before a launch", "before launch")
            rec, ended = self._launch_once(monitor, resumed_from, group)
            d = self._decide(rec, ended)
            if not d.relaunch:
                failed = RunStatus.STOPPED if ended.stop_signal else RunStatus.FAILED
                return self._finish(d.exit_code, _FINAL_STATUS.get(d.exit_code, failed), d.reason)
            self.log.emit(
                ev.Relaunch(wait_s=round(d.wait_s, 3), restarts=len(self.state.restart_times)), d.reason
            )
            self._save(RunStatus.RESTARTING, reason=d.reason, child_pid=None)
            if not self._sleep(d.wait_s):
                return self._interrupted("between launches", "during backoff")

    def _start_up(self) -> Monitor:
        """The state a previous watchdog left, the start event, the node-local heartbeat folder;
        returns the monitor that watches each launch in it."""
        subreaper = process.become_subreaper()
        self.cfg.root.mkdir(parents=True, exist_ok=True)  # the root itself: the user's to choose
        self.states.load(self._io, reset=self.cfg.reset_budget)
        carried = len(self.state.restart_times)
        self.log.emit(
            ev.WatchdogStart(
                pid=os.getpid(), command=list(self.cfg.command), restarts_carried=carried, subreaper=subreaper
            ),
            f"watchdog pid {os.getpid()} on {self.host} node {self.cfg.node}: {' '.join(self.cfg.command)}"
            + (f" ({carried} earlier restarts count against the budget)" if carried else ""),
        )
        self._node_local()
        self._save(reason="starting")
        if self.cfg.metrics_file is not None:
            self.metrics = MetricsFile(self.cfg.root, self.cfg.metrics_file, self.cfg.metrics_interval_s)
            self.metrics.start()
        hangs = Hangs(self.cfg, self.log, self.hb_dir, self.host)
        return Monitor(self.cfg, self.log, self.hb_dir, self.host, self.signals, hangs)

    def _node_local(self) -> None:
        """The node-local heartbeat folder this node's ranks get, and the thread publishing the
        node's summary from it (none when the folder cannot be made: the ranks then write into
        the run directory, as without a watchdog)."""
        base = self.cfg.node_dir or node_local_base()
        self.hb_dir, msg = node_summary.choose_folder(base, self.cfg.root, self.cfg.node)
        self.log.emit(ev.HeartbeatDir(path=str(self.hb_dir)), msg)
        local = self.hb_dir != RunDir.of(self.cfg.root).heartbeats
        if self.cfg.memory_tier:
            self.memory.start(base, self.cfg.root, self.cfg.node, local)
        if self.memory.folder is not None and self.cfg.nodes > 1:
            self.buddy = Buddy(
                self.log,
                RunDir.of(self.cfg.root),
                self.memory.folder,
                self.cfg.node,
                self.cfg.nodes,
                self.cfg.replica_bandwidth,
                self.cfg.poll_s,
            )
            self.buddy.start(self.cfg.sign_key)
        if not local and not self.cfg.roster:
            return  # under a roster the summary is the node's readiness: published all the same
        facts = node_summary.NodeFacts(self.cfg.node, self.host, os.getpid(), self.cfg.summary_interval_s)
        self.publisher = node_summary.Publisher(self.cfg.root, self.hb_dir, facts, self.cfg.timeouts)
        self.publisher.start()

    def _pick(self) -> int | None:
        """The step to resume from, timed as part of a recovery: a memory snapshot (memory.py)
        when one is usable, else the disk tier's pick (picker.py)."""
        if self.recovering is not None:
            self.recovering[Moment.BACKED_OFF] = time.time()
        first = self.state.launch_count == 0
        standing_in = self.follower is not None and self.follower.stands_in_for is not None
        resumed_from = None if first and not standing_in else self._memory_pick()
        if resumed_from is None:
            resumed_from = self.picker.pick(first_launch=first)
        if resumed_from is None:  # another trainer's checkpoints (torchtitan's step-N/): it resumes itself
            resumed_from = self._io(lambda: store.newest_foreign_step(self.cfg.root), "listing checkpoints")
        if self.recovering is not None:
            self.recovering[Moment.CHECKPOINT_PICKED] = time.time()
        return resumed_from

    def _memory_pick(self) -> int | None:
        """The memory snapshot's step the next launch resumes from, or None (the disk tier's)."""
        if self.memory.folder is None:
            return None
        refs = self._io(lambda: store.list_checkpoints(self.cfg.root), "listing checkpoints")
        stand_in = self.follower.stands_in_for if self.follower is not None else None
        fetch = self.buddy.fetch if self.buddy is not None else None
        return self.memory.pick(
            self.state.launch_count + 1, refs[0].step if refs else None, stand_in, fetch, self.cfg.nodes > 1
        )

    def _decide(self, rec: LaunchRecord, ended: Ended) -> restart_policy.Decision:
        """The restart policy's decision on the launch that ended (its record is the newest of the
        history); a relaunch counts against the budget."""
        now = time.time()
        d = restart_policy.decide(
            rec,
            self.state.launches,
            self.state.restart_times,
            now,
            self.cfg.policy,
            preempted=ended.preempted,
            stop_signal=ended.stop_signal,
        )
        if d.counts_as_restart:
            self._save(restart_times=(*self.state.restart_times, now))
        return d

    def _interrupted(self, notice_when: str, stop_when: str) -> int:
        """End on the signal that cut a wait short: a stop (128+N), or a preemption notice under
        --requeue-exit (13: the newest checkpoint stands)."""
        if self.signals.stop is None:
            why = f"preemption notice {notice_when}: the newest checkpoint stands; requeue"
            return self._finish(Exit.REQUEUE_REQUESTED, RunStatus.REQUEUED, why)
        return self._finish(128 + self.signals.stop, RunStatus.STOPPED, f"stopped {stop_when}")

    def _finish(self, code: int, status: RunStatus, reason: str) -> int:
        self.log.emit(
            ev.WatchdogExit(exit_code=code, status=status.value), f"watchdog exits {code}: {reason}"
        )
        self._save(status, reason=reason, exit_code=code, child_pid=None)
        if self.log.pending:
            events.say(f"[supervisor] {self.log.path} could not be written: the last events are only above")
        return code

    def _sleep(self, seconds: float) -> bool:
        """Back off; False when a stop signal, or with --requeue-exit a preemption notice, arrived
        meanwhile (without --requeue-exit the notice waits for the next launch's ranks)."""
        deadline = time.monotonic() + seconds
        while True:
            if self.signals.interrupted:
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(min(SIGNAL_POLL_S, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------ one launch

    def _launch_once(
        self, monitor: Monitor, resumed_from: int | None, group: GroupFacts | None = None
    ) -> tuple[LaunchRecord, Ended]:
        number = self.state.launch_count + 1
        self.oom_kills = oom.cgroup_oom_kills()
        release = group.to_json() if group is not None else ""
        launch_id, child = self.standby.take(number, release) or self._start_launch(number, group=group)
        if self.recovering is not None:
            self.recovering[Moment.PROCESS_STARTED] = child.started
        try:  # whatever goes wrong in here, nothing of the launch outlives it
            self._save(
                RunStatus.RUNNING,
                reason=f"launch {number} running",
                launch_count=number,
                launch_id=launch_id,
                child_pid=child.pid,
                launch_started=child.started,
                exit_code=None,
            )
            self.log.emit(
                ev.Launch(launch=number, launch_id=launch_id, pid=child.pid, resumed_from=resumed_from),
                f"launch {number} (id {launch_id}) pid {child.pid}, resuming from "
                + ("scratch" if resumed_from is None else f"step {resumed_from}"),
            )
            self._publish(launch_id=launch_id)
            ended = monitor.watch(child, launch_id, self._on_beats)
        finally:
            note = child.finish()
            if note:
                self.log.emit(
                    ev.Kill(unreaped=child.unreaped), f"launch {number}: killed what was left: {note}"
                )
        killed = time.time()
        beats = detectors.launch_heartbeats(read_heartbeat_folder(self.hb_dir), launch_id)
        self._track_recovery(beats, number, final=True)
        self.recovering = {Moment.DETECTED: ended.detected or killed, Moment.TREE_KILLED: killed}
        self.recovering.update(failed_at(ended, beats))
        cls = self._classify(ended, beats)
        cause = self._root_cause(launch_id, number, beats, ended.dead) if cls.outcome in FAILURES else ""
        if cause:
            cls = replace(cls, reason=f"{cls.reason}; root cause {cause}")
        if child.unreaped:
            cls = replace(
                cls, reason=f"{cls.reason}; left behind, SIGKILL could not end: {'; '.join(child.unreaped)}"
            )
        self._publish(launch_id="", verdict=f"launch {number}: {cls.reason}", culprit=ended.culprit)
        refs = self._io(lambda: store.list_checkpoints(self.cfg.root), "listing checkpoints")
        rec = LaunchRecord(
            number=number,
            launch_id=launch_id,
            started=child.started,
            ended=time.time(),
            outcome=cls.outcome,
            reason=cls.reason,
            resumed_from=resumed_from,
            newest_after=refs[0].step
            if refs
            else self._io(lambda: store.newest_foreign_step(self.cfg.root), "listing checkpoints"),
            last_step=died_at(beats),
        )
        self.log.emit(
            ev.LaunchEnd(
                launch=number,
                launch_id=launch_id,
                outcome=cls.outcome.value,
                returncode=ended.returncode,
                rank_exit_codes={str(b.rank): b.exit_code for b in beats if b.exit_code is not None},
                last_step=rec.last_step,
                newest_checkpoint=rec.newest_after,
            ),
            f"launch {number} ended after {rec.ended - rec.started:.1f}s "
            f"{restart_policy.where_died(rec.last_step)}: {cls.reason}",
        )
        self._save(launches=self.state.with_launch(rec).launches)
        self._prune_launch_dirs()
        return rec, ended

    def _prune_launch_dirs(self) -> None:
        """Remove this node's launch directories that the state file no longer records (and
        that are not the standby's), best effort."""
        keep = [r.launch_id for r in self.state.launches]
        if self.standby.launch_id is not None:
            keep.append(self.standby.launch_id)
        failed = launch_dirs.prune(RunDir.of(self.cfg.root), self.cfg.node, keep)
        if failed:
            events.say(
                f"[supervisor] old launch dirs not removed (tried after the next launch): {'; '.join(failed)}"
            )

    def _launch_env(self, launch_id: str, number: int) -> dict[str, str]:
        """The command's environment: the launch's id and count, the phase timeouts (the ranks
        bound their own waits under them), the TCPStore fix where torchrun
        may restart its ranks itself (``torchrun_cmd.restarts_inside``), and, when the
        launch's own directory can be made (best effort, like the event log: a run directory the
        watchdog cannot write must not stop the training), torchelastic's error file and
        torchrun's log dir in it (the root cause is read from them)."""
        env = dict(os.environ)
        env[ENV_LAUNCH_ID] = launch_id
        env[ENV_RESTART_COUNT] = str(number - 1)
        env[HEARTBEAT_DIR_ENV] = str(self.hb_dir)
        env[ENV_PHASE_TIMEOUTS] = json.dumps(self.cfg.timeouts.to_dict())
        env.update(self.memory.env())
        env.update(recorder_env(env, self.cfg.flight_recorder))  # a hang's collectives (hangs.py)
        if self.cfg.share_store_fix and restarts_inside(self.cfg.command):
            env.setdefault(SHARE_STORE_ENV, "1")
        run = RunDir.of(self.cfg.root)
        try:
            confined.make_dirs(run.root, run.launch_dir(launch_id))  # through no link below the root
        except OSError as e:
            events.say(
                f"[supervisor] {run.launch_dir(launch_id)} not created ({describe(e)}): "
                f"launch {number} runs without torchelastic's error files (no root cause)"
            )
            return env
        env[ELASTIC_ERROR_FILE_ENV] = str(run.error_file(launch_id))
        env.setdefault(ELASTIC_LOG_DIR_ENV, str(run.elastic_logs(launch_id)))
        return env

    def _start_launch(
        self, number: int, standby: bool = False, group: GroupFacts | None = None
    ) -> tuple[str, process.Child]:
        """Start COMMAND as launch ``number``; a standby's ranks wait for its release (under a
        roster their group's facts come with it, a cold launch's in its environment)."""
        lid = launch_id(self.host, self.cfg.node, os.getpid(), number, uuid.uuid4().hex[:6])
        env = self._launch_env(lid, number)
        if standby:
            env[ENV_STANDBY_RELEASE] = str(RunDir.of(self.cfg.root).release_file(lid))
            env[ENV_WATCHDOG_PID] = str(os.getpid())
        if self.cfg.roster:
            env[ENV_GROUP] = RELEASED if standby or group is None else group.to_json()
        return lid, self._start(env, own_subtree=standby)

    # ------------------------------------------------------------ standby (--standby)

    def _start(self, env: dict[str, str], own_subtree: bool = False) -> process.Child:
        """Start COMMAND; one that cannot be executed stops the watchdog (exit 12) with a line
        naming it, a transient error reaches run() (exit 14)."""
        try:
            return process.Child(
                list(self.cfg.command),
                env,
                reap_timeout_s=self.cfg.reap_timeout_s,
                abandoned=self.abandoned,
                own_subtree=own_subtree,
                ignored=(signal.SIGUSR1, self.cfg.notice_signal),
            )
        except OSError as e:
            if e.errno not in CANNOT_EXEC:
                raise
            raise Stop(
                Exit.CHILD_NONRETRYABLE,
                f"cannot start {self.cfg.command[0]}: {describe(e)}; fix COMMAND (a path, or a program on PATH)",
            ) from None

    def _on_beats(self, child: process.Child, beats: list[Heartbeat]) -> None:
        """Each poll's heartbeats: the recovery's breakdown once the ranks have made a step; the
        straggler verdict when due (node 0); then, with --standby and no recovery under way, the
        next launch started ahead."""
        self._track_recovery(beats, self.state.launch_count)
        self.stragglers.check([b for b in beats if b.host == self.host])
        if self.cfg.standby and self.recovering is None:
            self.standby.keep(child, beats, self.state.launch_count + 1)

    def _track_recovery(self, beats: list[Heartbeat], number: int, *, final: bool = False) -> None:
        """Once this launch's ranks here have all made their first step, the recovery that led to
        it is recorded (a recovery event, and state.json for status); ``final``: the launch ended,
        so what it reached is recorded, first step or not."""
        if self.recovering is None:
            return
        at = {**self.recovering, **recovery.rank_moments(beats, self.host)}
        if not (final or recovery.complete(at)):
            return
        self.recovering = None
        self.memory.note_rejected()
        phases = recovery.breakdown(at)
        self.log.emit(
            ev.Recovery(launch=number, phases=phases),
            f"launch {number} recovery: {recovery.describe(phases)}",
        )
        self._save(recovery=phases)

    def _keep_standby(self, wanted: bool) -> None:
        """While this node waits for its roster: its next launch kept started ahead (a spare's
        imports done), or dropped when the roster leaves the node out."""
        if wanted:
            self.standby.ensure(self.state.launch_count + 1)
        else:
            self.standby.drop("not needed: the roster leaves this node out")

    def _poke(self) -> None:
        """The node summary written now (the roster's readiness), not at its next interval."""
        if self.publisher is not None:
            self.publisher.poke()

    def _publish(self, **facts: object) -> None:
        """News for the node summary (written at its next interval)."""
        if self.publisher is not None:
            self.publisher.update(**facts)

    def _root_cause(
        self, launch_id: str, number: int, beats: list[Heartbeat], dead: list[detectors.DeadRank]
    ) -> str:
        """How the launch failed, as a root_cause event: the first rank to fail (by time: an
        exception when it was raised, a kill at the rank's last beat) with its exception, from its
        heartbeat or torchelastic's error file, or the signal that killed it (and the OOM killer's
        word, where readable); the others' failures as its consequences. Without a rank known to
        have failed, the launched command's own error file. '' when nothing is known."""
        run = RunDir.of(self.cfg.root)
        local = {b.local_rank: b.rank for b in beats if b.host == self.host}
        causes, problems = rootcause.worker_causes(run.elastic_logs(launch_id), local)
        unusable = f" (unusable: {'; '.join(problems)})" if problems else ""
        after = oom.cgroup_oom_kills()

        def killed(hb: Heartbeat) -> str:
            kernel = oom.kernel_kill_line(hb.pid) if hb.host == self.host else ""
            return oom.killed_note(hb.pid, kernel, self.oom_kills, after) or rootcause.KILLED

        ends = rootcause.rank_ends(beats, {d.rank for d in dead}, causes, killed)
        if ends:
            line = rootcause.describe_ends(ends)
            self.log.emit(
                rootcause.ends_event(number, problems, ends), f"launch {number}: root cause {line}{unusable}"
            )
            return line
        cause, problems = rootcause.find_root_cause(
            run.error_file(launch_id), run.elastic_logs(launch_id), local
        )
        unusable = f" (unusable: {'; '.join(problems)})" if problems else ""
        if cause is not None:
            msg = f"launch {number}: root cause {cause.describe()}{unusable}"
            self.log.emit(rootcause.file_event(number, problems, cause), msg)
            return cause.describe()
        if problems:
            msg = f"launch {number}: no root cause: error files unusable: {'; '.join(problems)}"
            self.log.emit(ev.RootCause(launch=number, problems=problems), msg)
        return ""

    def _classify(self, ended: Ended, beats: list[Heartbeat]) -> restart_policy.Classification:
        """A rank's deliberate exit code (non-retryable, requeue) wins: the deaths and hangs of
        the others may just be the fallout of it."""
        cls = restart_policy.classify_exit(ended.returncode, (b.exit_code for b in beats))
        if cls.outcome in (Outcome.NON_RETRYABLE, Outcome.REQUEUE, Outcome.STORAGE, Outcome.DONE):
            return cls
        if ended.stop_signal is not None:
            name = signal.Signals(ended.stop_signal).name
            return restart_policy.Classification(
                Outcome.STOPPED, ended.returncode, f"stopped by {name} ({cls.reason})"
            )
        if ended.dead:
            more = f" (+{len(ended.dead) - 1} more ranks)" if len(ended.dead) > 1 else ""
            return restart_policy.Classification(
                Outcome.CRASH, ended.returncode, f"{ended.dead[0].reason}{more}"
            )
        if ended.hangs:
            h = ended.hangs[0]
            more = f" (+{len(ended.hangs) - 1} more ranks)" if len(ended.hangs) > 1 else ""
            who = f"; {ended.culprit}" if ended.culprit else ""
            return restart_policy.Classification(
                Outcome.HANG, ended.returncode, f"hang: {h.reason}{more}{who}"
            )
        return cls

    # ------------------------------------------------------------ monitoring one launch


def failed_at(ended: Ended, beats: list[Heartbeat]) -> dict[Moment, float]:
    """When the ranks that failed the launch (dead or hung; else those that ended without an exit
    code or with a non-zero one) last beat: where its recovery starts (an upper bound of the
    detection's latency: beats are throttled); nothing when none beat."""
    bad = {d.rank for d in ended.dead} | {h.rank for h in ended.hangs if h.rank is not None}
    bad = bad or {b.rank for b in beats if b.exit_code != 0}
    last = [b.wall_time for b in beats if b.rank in bad]
    return {Moment.FAILED: max(last)} if last else {}


def died_at(beats: list[Heartbeat]) -> int | None:
    """The step a launch died at: the lowest step among its unfinished ranks (ranks move in
    lockstep, so the laggard is where the group stopped; the others may be one step ahead)."""
    running = [b.step for b in beats if b.phase != Phase.DONE]
    return min(running) if running else max((b.step for b in beats), default=None)


def watch(cfg: WatchConfig) -> int:
    return Watchdog(cfg).run()

"""The watchdog loop: pick -> launch -> monitor heartbeats -> classify -> decide -> back off.

Facts are gathered here (processes, heartbeat files, the store) and handed to the pure functions
in ``detectors.py`` (hung, dead ranks) and ``restart_policy.py`` (stop or relaunch); this
module only carries out what they decide and records it.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from supervisor import store
from supervisor.format import confined, events
from supervisor.format.atomic import atomic_write_text, hostname
from supervisor.format.eventnames import EventName
from supervisor.format.events import EventLog, RunState
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import (
    ENV_LAUNCH_ID,
    ENV_RESTART_COUNT,
    ENV_STANDBY_RELEASE,
    ENV_WATCHDOG_PID,
    Heartbeat,
    HeartbeatSnapshot,
    Mark,
    Phase,
    boot_id,
    read_heartbeat,
    read_heartbeat_folder,
)
from supervisor.format.launches import FAILURES, LaunchRecord, Outcome
from supervisor.format.layout import (
    HEARTBEAT_DIR_ENV,
    RunDir,
    heartbeat_filename,
    launch_id,
    node_local_base,
    stack_dump_filename,
)
from supervisor.ioerrors import StorageUnavailable, describe, retry_transient
from supervisor.watch import (
    culprit,
    detectors,
    launch_dirs,
    liveness,
    node_summary,
    process,
    recovery,
    restart_policy,
    rootcause,
)
from supervisor.watch.config import ELASTIC_ERROR_FILE_ENV, ELASTIC_LOG_DIR_ENV, SHARE_STORE_ENV, WatchConfig
from supervisor.watch.detectors import Hang
from supervisor.watch.recovery import Moment
from supervisor.watch.torchrun_cmd import restarts_inside

T = TypeVar("T")

SIGNAL_POLL_S = 0.05
# A check scheduled for when a silent rank's timeout runs out runs this much after it: its silence
# is then over the timeout, not equal to it.
HANG_DUE_SLACK_S = 0.01
# A rank died: its peers cannot progress (and may ignore SIGTERM inside a collective), and nothing
# they write can be committed without it, so the rest of the launch gets SIGKILL at once.
DEAD_RANK_KILL_GRACE_S = 0.0
# Every local rank vanished without an exit code: the launched command's exit code says whether
# they finished (torchrun took 1.2-1.9 s to exit after its last worker here); this long at most.
ALL_RANKS_GONE_WAIT_S = 30.0
FULL_SCAN_S = 10.0
# The command could not be started, and will not be on a retry: a usage error of COMMAND.
CANNOT_EXEC = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOEXEC})


@dataclass
class _Ended:
    """How one launch ended, as the monitor saw it."""

    returncode: int
    hangs: list[Hang] = field(default_factory=list)
    dead: list[detectors.DeadRank] = field(default_factory=list)
    stop_signal: int | None = None
    preempted: bool = False
    culprit: str = ""  # who hung it, from the stack dumps (culprit.py)
    detected: float = 0.0  # when the monitor saw it end (a dead rank, a hang, the command's exit)


class _Stop(Exception):
    """Stop the watchdog with ``code`` and the message as its verdict."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _Interrupted(Exception):
    """A stop signal (or, with --requeue-exit, a preemption notice) cut a storage retry short."""


class Watchdog:
    def __init__(self, cfg: WatchConfig) -> None:
        self.cfg = cfg
        self.host = hostname()
        self.log = EventLog(cfg.root, cfg.node)
        self.stop_signal: int | None = None
        self.preempt_pending = False
        self.step_times: list[float] = []
        # Processes a kill could not reap (state D on a hung mount): named once, then not waited for.
        self.abandoned: set[tuple[int, int]] = set()
        self.state_error = ""  # why the state file is not being written ('' while it is)
        self.state_loaded = False  # until the previous state is read, writing would clobber its budget
        # The relaunch under way: the moments of its recovery so far (None: no failure to recover from).
        self.recovering: dict[Moment, float] | None = None
        # With --standby: the next launch, started ahead (its number, id and process), or None.
        self.standby: tuple[int, str, process.Child] | None = None
        # Where this node's ranks write their heartbeats (node-local, see _node_local), and the
        # thread that publishes them as the node's summary.
        self.hb_dir = RunDir.of(cfg.root).heartbeats
        self.publisher: node_summary.Publisher | None = None
        # quarantine/'s entries as last seen: one that a launch's ranks added (a checkpoint that
        # failed their verify or their load) is logged, with its reason, before the relaunch.
        self.quarantined: set[str] | None = None
        self.state = RunState(
            node=cfg.node,
            host=self.host,
            watchdog_pid=os.getpid(),
            command=cfg.command,
            timeouts=cfg.timeouts.to_dict(),
            started=time.time(),
        )

    # ------------------------------------------------------------ state

    def _initial_state(self) -> RunState:
        """The budget and history a previous watchdog left; a garbage file is kept as .bad and
        the budget starts over; an unreadable one is retried, then StorageUnavailable."""
        path = events.state_path(self.cfg.root, self.cfg.node)
        try:
            prev = self._io(lambda: events.read_state(path), f"reading {path}")
        except ValueError as e:
            bad = path.with_suffix(".json.bad")
            try:
                confined.rename(self.cfg.root, path, bad)
                kept = f"the old file is kept as {bad.name}"
            except OSError as err:
                kept = f"the old file could not be moved aside ({describe(err)})"
            self.log.emit(EventName.STATE_UNREADABLE, f"{e}; starting with a fresh budget ({kept})")
            prev = None
        self.state_loaded = True
        if prev is None or self.cfg.reset_budget:
            return self.state
        return replace(
            self.state,
            restart_times=prev.restart_times,
            launches=prev.launches,
            launch_count=prev.launch_count,
        )

    def _save(self, **changes: object) -> None:
        """Update the state and write it, best effort: on failure the state is kept in memory, one
        line goes to stderr, and the next save writes all of it."""
        # replace() checks each field name at run time; mypy cannot type **changes per field
        self.state = replace(self.state, **changes)  # type: ignore[arg-type]
        st = self.state
        self._publish(
            status=st.status,
            reason=st.reason,
            exit_code=st.exit_code,
            launch_count=st.launch_count,
            restarts=len(st.restart_times),
        )
        if not self.state_loaded:
            return
        try:
            events.write_state(self.cfg.root, self.state)
        except OSError as e:
            if not self.state_error:
                self.state_error = describe(e)
                path = events.state_path(self.cfg.root, self.cfg.node)
                events.say(
                    f"[supervisor] state file {path} not written ({self.state_error}); kept in memory, "
                    "written again at the next change"
                )
            return
        if self.state_error:
            events.say(f"[supervisor] state file written again (it failed with {self.state_error})")
            self.state_error = ""

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
        self.log.emit(EventName.IO_RETRY, msg)
        self._save(reason=f"storage trouble, retrying: {msg}")

    def _pick_retry(self, msg: str) -> None:
        """A retry of the pick; a stop signal (or a preemption notice with --requeue-exit) ends
        the retries, as it ends a backoff wait."""
        self._io_retry(msg)
        if self.stop_signal is not None or (self.preempt_pending and self.cfg.policy.requeue_exit):
            raise _Interrupted(msg)

    # ------------------------------------------------------------ signals

    def _install_signals(self) -> None:
        def stop(signum: int, _frame: object) -> None:
            if self.stop_signal is None:
                self.stop_signal = signum

        def preempt(_signum: int, _frame: object) -> None:
            self.preempt_pending = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(self.cfg.notice_signal, preempt)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """The loop, and its verdict on the storage: a transient error that outlasted --io-retry,
        or any other the watchdog met in the run directory, is exit 14 (requeue-able), never the
        usage code and never a traceback."""
        self._install_signals()
        try:
            return self._run()
        except _Stop as e:
            return self._finish(e.code, events.FAILED, str(e))
        except StorageUnavailable as e:
            return self._finish(Exit.STORAGE_UNAVAILABLE, events.FAILED, str(e))
        except OSError as e:
            why = (
                f"{e.filename or self.cfg.root}: {describe(e)}: the watchdog cannot use the run directory; "
                "check the file system (mount, server, permissions, quota), then requeue"
            )
            return self._finish(Exit.STORAGE_UNAVAILABLE, events.FAILED, why)
        finally:
            self._drop_standby()
            if self.publisher is not None:
                self.publisher.stop()

    def _node_local(self) -> None:
        """The node-local heartbeat folder this node's ranks get, and the thread publishing the
        node's summary from it (none when the folder cannot be made: the ranks then write into
        the run directory, as without a watchdog)."""
        base = self.cfg.node_dir or node_local_base()
        self.hb_dir, msg = node_summary.choose_folder(base, self.cfg.root, self.cfg.node)
        self.log.emit(EventName.HEARTBEAT_DIR, msg, path=str(self.hb_dir))
        if self.hb_dir == RunDir.of(self.cfg.root).heartbeats:
            return
        facts = node_summary.NodeFacts(self.cfg.node, self.host, os.getpid(), self.cfg.summary_interval_s)
        self.publisher = node_summary.Publisher(self.cfg.root, self.hb_dir, facts, self.cfg.timeouts)
        self.publisher.start()

    def _run(self) -> int:
        subreaper = process.become_subreaper()
        self.cfg.root.mkdir(parents=True, exist_ok=True)  # the root itself: the user's to choose
        self.state = self._initial_state()
        carried = len(self.state.restart_times)
        self.log.emit(
            EventName.WATCHDOG_START,
            f"watchdog pid {os.getpid()} on {self.host} node {self.cfg.node}: {' '.join(self.cfg.command)}"
            + (f" ({carried} earlier restarts count against the budget)" if carried else ""),
            pid=os.getpid(),
            command=list(self.cfg.command),
            restarts_carried=carried,
            subreaper=subreaper,
        )
        self._node_local()
        self._save(status=events.RESTARTING, reason="starting")
        while True:
            if self.recovering is not None:
                self.recovering[Moment.BACKED_OFF] = time.time()
            resumed_from = self._pick()
            if self.recovering is not None:
                self.recovering[Moment.CHECKPOINT_PICKED] = time.time()
            if self.stop_signal is not None:
                return self._finish(128 + self.stop_signal, events.STOPPED, "stopped before launch")
            if self.preempt_pending and self.cfg.policy.requeue_exit:
                why = "preemption notice before a launch: the newest checkpoint stands; requeue"
                return self._finish(Exit.REQUEUE_REQUESTED, events.REQUEUED, why)
            rec, ended = self._launch_once(resumed_from)
            history = self.state.launches
            now = time.time()
            d = restart_policy.decide(
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
                final: dict[int, str] = {
                    Exit.OK: events.DONE,
                    Exit.REQUEUE_REQUESTED: events.REQUEUED,
                }
                status = final.get(d.exit_code, events.STOPPED if ended.stop_signal else events.FAILED)
                return self._finish(d.exit_code, status, d.reason)
            self.log.emit(EventName.RELAUNCH, d.reason, wait_s=round(d.wait_s, 3), restarts=len(restarts))
            self._save(status=events.RESTARTING, reason=d.reason, child_pid=None)
            if not self._sleep(d.wait_s):
                if self.stop_signal is None:  # a preemption notice with --requeue-exit
                    why = "preemption notice between launches: the newest checkpoint stands; requeue"
                    return self._finish(Exit.REQUEUE_REQUESTED, events.REQUEUED, why)
                return self._finish(128 + self.stop_signal, events.STOPPED, "stopped during backoff")

    def _finish(self, code: int, status: str, reason: str) -> int:
        self.log.emit(EventName.EXIT, f"watchdog exits {code}: {reason}", exit_code=code, status=status)
        self._save(status=status, reason=reason, exit_code=code, child_pid=None)
        if self.log.pending:
            events.say(f"[supervisor] {self.log.path} could not be written: the last events are only above")
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

    def _pick(self) -> int | None:
        """Step to resume from (None: from scratch); _Stop when the run must not go on. An
        unreadable checkpoint is retried for --io-retry (io_retry events), then
        StorageUnavailable; no usable checkpoint while the run has history stops the watchdog
        unless --allow-fresh-start."""
        self._log_quarantined_by_the_ranks()
        if self.cfg.remote:
            return self._pick_across_tiers(self.cfg.remote)
        if self.state.launch_count == 0:  # the trainer picks on its first start: only for the record
            refs = self._io(lambda: store.list_checkpoints(self.cfg.root), "listing checkpoints")
            return refs[0].step if refs else None
        try:
            res = store.pick(
                self.cfg.root,
                deep=self.cfg.deep_verify,
                io_retry_s=self.cfg.io_retry_s,
                on_retry=self._pick_retry,
                allow_fresh_start=self.cfg.allow_fresh_start,
                key=self.cfg.sign_key,
            )
        except _Interrupted:
            return None  # run() acts on the signal
        except store.MismatchError as e:
            raise _Stop(Exit.CHILD_NONRETRYABLE, f"checkpoint does not match this run: {e}") from None
        except store.NoUsableCheckpoint as e:
            self._log_skipped(e.result)
            raise _Stop(Exit.CHILD_NONRETRYABLE, str(e)) from None
        except confined.Escape as e:  # a link planted in the run dir where the pick must move: a person looks
            raise _Stop(Exit.CHILD_NONRETRYABLE, str(e)) from None
        self._log_skipped(res)
        self._note_quarantined()  # what the pick itself moved is logged above, not again
        chosen = res.chosen.ref if res.chosen else None
        how = "deep" if self.cfg.deep_verify else "quick"
        msg = (
            f"resume from {chosen.name} ({how} check passed)"
            if chosen
            else "no valid checkpoint: start from scratch"
        )
        self.log.emit(EventName.PICK, msg, checkpoint=chosen.name if chosen else None, verify=how)
        return chosen.step if chosen else None

    def _log_quarantined_by_the_ranks(self) -> None:
        """A ``quarantine`` event for each entry of quarantine/ not there at the last look (the
        first look only takes note): the ranks move a checkpoint aside themselves when its deep
        verify or its load finds it corrupt, and the walk-back that follows is said here, with
        their reason. Best effort: a quarantine that cannot be listed is the pick's to report."""
        before = self.quarantined
        now = self._note_quarantined()
        if now is None or before is None:
            return
        for name in sorted(set(now) - before):
            step = name.split("-", 1)[0]
            why = now[name]
            self.log.emit(
                EventName.QUARANTINE, f"quarantined {step} (by the ranks): {why}", checkpoint=step, why=why
            )

    def _note_quarantined(self) -> dict[str, str] | None:
        """quarantine/'s entries now (name -> reason), taken note of for the next look; None when
        it cannot be listed."""
        try:
            now = {q.name: q.reason for q in store.list_quarantined(self.cfg.root)}
        except OSError:
            return None
        self.quarantined = set(now)
        return now

    def _log_skipped(self, res: store.PickResult) -> None:
        """What the pick walked past: quarantined (corrupt) and untrusted (not signed) ones."""
        for name, why in res.quarantined:
            self.log.emit(EventName.QUARANTINE, f"quarantined {name}: {why}", checkpoint=name, why=why)
        for name, why in res.untrusted:
            self.log.emit(
                EventName.UNTRUSTED, f"skipped {name}, not trusted: {why}", checkpoint=name, why=why
            )

    def _pick_across_tiers(self, url: str) -> int | None:
        """Before every launch, the first included (after node loss nothing is local): the newest
        valid checkpoint of either tier, downloaded when only the remote has it. An unreachable
        remote with nothing valid locally is waited for (backing off), never silently skipped;
        past --remote-wait it is a storage verdict (exit 14), as unreadable local storage is."""
        from supervisor.tiers.remote import RemoteUnavailable, open_remote
        from supervisor.tiers.resume import prepare_resume

        how = "deep" if self.cfg.deep_verify else "quick"
        deadline = time.monotonic() + self.cfg.remote_wait_s
        wait = self.cfg.policy.backoff.initial_s or 1.0
        while True:
            try:
                key = self.cfg.sign_key
                remote = open_remote(url, self.cfg.remote_endpoint, key=key)
                res = prepare_resume(
                    self.cfg.root,
                    remote,
                    deep=self.cfg.deep_verify,
                    on_event=self.log.emit,
                    io_retry_s=self.cfg.io_retry_s,
                    on_retry=self._pick_retry,
                    allow_fresh_start=self.cfg.allow_fresh_start,
                    key=key,
                )
            except _Interrupted:
                return None  # run() acts on the signal
            except store.MismatchError as e:
                raise _Stop(Exit.CHILD_NONRETRYABLE, f"checkpoint does not match this run: {e}") from None
            except (store.NoUsableCheckpoint, confined.Escape) as e:
                raise _Stop(Exit.CHILD_NONRETRYABLE, str(e)) from None
            except RemoteUnavailable as e:
                # Every failed attempt is logged, the last one too: a slow refusal (client retries)
                # can use up the whole wait in one attempt.
                giving_up = time.monotonic() >= deadline
                then = "giving up" if giving_up else f"retrying in {wait:.0f}s"
                self.log.emit(EventName.REMOTE_UNAVAILABLE, f"{e}; nothing valid locally: {then}")
                if giving_up:
                    raise _Stop(
                        Exit.STORAGE_UNAVAILABLE,
                        f"remote {url} unreachable for {self.cfg.remote_wait_s:.0f}s and no "
                        f"valid local checkpoint: {e}",
                    ) from None
                if not self._sleep(wait):
                    return None  # a stop signal or a preemption notice: run() decides
                wait = min(wait * 2, self.cfg.policy.backoff.max_s)
                continue
            self._note_quarantined()  # what the pick itself moved it logged itself
            chosen = res.chosen
            msg = (
                f"resume from {chosen.name} ({res.source}, {how} check passed)"
                if chosen
                else "no valid checkpoint on either tier: start from scratch"
            )
            self.log.emit(
                EventName.PICK, msg, checkpoint=chosen.name if chosen else None, verify=how, source=res.source
            )
            return chosen.step if chosen else None

    def _launch_once(self, resumed_from: int | None) -> tuple[LaunchRecord, _Ended]:
        number = self.state.launch_count + 1
        launch_id, child = self._take_standby(number) or self._start_launch(number)
        if self.recovering is not None:
            self.recovering[Moment.PROCESS_STARTED] = child.started
        try:  # whatever goes wrong in here, nothing of the launch outlives it
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
                EventName.LAUNCH,
                f"launch {number} (id {launch_id}) pid {child.pid}, resuming from "
                + ("scratch" if resumed_from is None else f"step {resumed_from}"),
                launch=number,
                launch_id=launch_id,
                pid=child.pid,
                resumed_from=resumed_from,
            )
            self._publish(launch_id=launch_id)
            ended = self._monitor(child, launch_id)
        finally:
            note = child.finish()
            if note:
                self.log.emit(
                    EventName.KILL, f"launch {number}: killed what was left: {note}", unreaped=child.unreaped
                )
        killed = time.time()
        beats = detectors.launch_heartbeats(read_heartbeat_folder(self.hb_dir), launch_id)
        self._track_recovery(beats, number, final=True)
        self.recovering = {Moment.DETECTED: ended.detected or killed, Moment.TREE_KILLED: killed}
        self.recovering.update(failed_at(ended, beats))
        cls = self._classify(ended, beats)
        cause = self._root_cause(launch_id, number, beats) if cls.outcome in FAILURES else None
        if cause is not None:
            cls = replace(cls, reason=f"{cls.reason}; root cause {cause.describe()}")
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
            newest_after=refs[0].step if refs else None,
            last_step=died_at(beats),
        )
        self.log.emit(
            EventName.LAUNCH_END,
            f"launch {number} ended after {rec.ended - rec.started:.1f}s "
            f"{restart_policy.where_died(rec.last_step)}: {cls.reason}",
            launch=number,
            launch_id=launch_id,
            outcome=cls.outcome.value,
            returncode=ended.returncode,
            rank_exit_codes={b.rank: b.exit_code for b in beats if b.exit_code is not None},
            last_step=rec.last_step,
            newest_checkpoint=rec.newest_after,
        )
        self._save(launches=self.state.with_launch(rec).launches)
        self._prune_launch_dirs()
        return rec, ended

    def _prune_launch_dirs(self) -> None:
        """Remove this node's launch directories that the state file no longer records (and
        that are not the standby's), best effort."""
        keep = [r.launch_id for r in self.state.launches]
        if self.standby is not None:
            keep.append(self.standby[1])
        failed = launch_dirs.prune(RunDir.of(self.cfg.root), self.cfg.node, keep)
        if failed:
            events.say(
                f"[supervisor] old launch dirs not removed (tried after the next launch): {'; '.join(failed)}"
            )

    def _launch_env(self, launch_id: str, number: int) -> dict[str, str]:
        """The command's environment: the launch's id and count, the TCPStore fix where torchrun
        may restart its ranks itself (``torchrun_cmd.restarts_inside``), and, when the
        launch's own directory can be made (best effort, like the event log: a run directory the
        watchdog cannot write must not stop the training), torchelastic's error file and
        torchrun's log dir in it (the root cause is read from them)."""
        env = dict(os.environ)
        env[ENV_LAUNCH_ID] = launch_id
        env[ENV_RESTART_COUNT] = str(number - 1)
        env[HEARTBEAT_DIR_ENV] = str(self.hb_dir)
        if self.cfg.share_store_fix and restarts_inside(self.cfg.command):
            env.setdefault(SHARE_STORE_ENV, "1")
        run = RunDir.of(self.cfg.root)
        try:
            confined.make_dirs(run.root, run.launch_dir(launch_id))
        except OSError as e:
            events.say(
                f"[supervisor] {run.launch_dir(launch_id)} not created ({describe(e)}): "
                f"launch {number} runs without torchelastic's error files (no root cause)"
            )
            return env
        env[ELASTIC_ERROR_FILE_ENV] = str(run.error_file(launch_id))
        env.setdefault(ELASTIC_LOG_DIR_ENV, str(run.elastic_logs(launch_id)))
        return env

    def _start_launch(self, number: int, standby: bool = False) -> tuple[str, process.Child]:
        """Start COMMAND as launch ``number``; a standby's ranks wait for _take_standby."""
        lid = launch_id(self.host, self.cfg.node, os.getpid(), number, uuid.uuid4().hex[:6])
        env = self._launch_env(lid, number)
        if standby:
            env[ENV_STANDBY_RELEASE] = str(RunDir.of(self.cfg.root).release_file(lid))
            env[ENV_WATCHDOG_PID] = str(os.getpid())
        return lid, self._start(env, own_subtree=standby)

    # ------------------------------------------------------------ standby (--standby)

    def _keep_standby(self, child: process.Child, beats: list[Heartbeat]) -> None:
        """With --standby, once the running launch's ranks here have all made a step (not
        earlier: a standby importing torch would slow a recovery on the same cores), start the
        next launch ahead of a failure; its ranks wait with their imports done."""
        if not self.cfg.standby or self.standby is not None or self.recovering is not None:
            return
        local = [b for b in beats if b.host == self.host]
        if not local or not all(Mark.FIRST_STEP.value in b.marks for b in local):
            return
        number = self.state.launch_count + 1
        launch_id, spare = self._start_launch(number, standby=True)
        self.standby = (number, launch_id, spare)
        child.excluded = {spare.pid}
        self.log.emit(
            EventName.STANDBY,
            f"standby for launch {number} (id {launch_id}) started, pid {spare.pid}: released on a relaunch",
            launch=number,
            launch_id=launch_id,
            pid=spare.pid,
        )

    def _take_standby(self, number: int) -> tuple[str, process.Child] | None:
        """Release the standby as launch ``number``: None (start cold) without one, or when it
        died meanwhile (the reason is in the event log)."""
        if self.standby is None:
            return None
        made_for, launch_id, spare = self.standby
        self.standby = None
        why = f"exited {spare.returncode()}" if spare.poll() is not None else ""
        why = why or (f"made for launch {made_for}" if made_for != number else "")
        if not why:
            try:
                run = RunDir.of(self.cfg.root)
                atomic_write_text(run.release_file(launch_id), f"{time.time()}\n", run.root)
            except OSError as e:
                why = f"its release file could not be written: {describe(e)}"
        if why:
            self.log.emit(EventName.KILL, f"standby {launch_id} not used ({why}): {spare.kill(0.0)}")
            return None
        spare.own_subtree = False
        spare.started, spare.started_mono = time.time(), time.monotonic()
        return launch_id, spare

    def _drop_standby(self) -> None:
        """The watchdog is done: the standby goes, never released."""
        if self.standby is not None:
            _, launch_id, spare = self.standby
            self.standby = None
            self.log.emit(EventName.KILL, f"standby {launch_id} not needed: {spare.kill(0.0)}")

    def _root_cause(self, launch_id: str, number: int, beats: list[Heartbeat]) -> rootcause.RootCause | None:
        """The exception that ended the launch, from torchelastic's error files (ranks that use
        @record write them), as a root_cause event; None when no rank wrote one."""
        run = RunDir.of(self.cfg.root)
        local = {b.local_rank: b.rank for b in beats if b.host == self.host}
        cause, problems = rootcause.find_root_cause(
            run.error_file(launch_id), run.elastic_logs(launch_id), local
        )
        unusable = f" (unusable: {'; '.join(problems)})" if problems else ""
        if cause is not None:
            msg = f"launch {number}: root cause {cause.describe()}{unusable}"
            self.log.emit(EventName.ROOT_CAUSE, msg, launch=number, problems=problems, **cause.fields())
        elif problems:
            msg = f"launch {number}: no root cause: error files unusable: {'; '.join(problems)}"
            self.log.emit(EventName.ROOT_CAUSE, msg, launch=number, problems=problems)
        return cause

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
        phases = recovery.breakdown(at)
        self.log.emit(
            EventName.RECOVERY,
            f"launch {number} recovery: {recovery.describe(phases)}",
            launch=number,
            phases=phases,
        )
        self._save(recovery=phases)

    def _publish(self, **facts: str | int | None) -> None:
        """News for the node summary (written at its next interval)."""
        if self.publisher is not None:
            self.publisher.update(**facts)

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
            )
        except OSError as e:
            if e.errno not in CANNOT_EXEC:
                raise
            raise _Stop(
                Exit.CHILD_NONRETRYABLE,
                f"cannot start {self.cfg.command[0]}: {describe(e)}; fix COMMAND (a path, or a program on PATH)",
            ) from None

    def _classify(self, ended: _Ended, beats: list[Heartbeat]) -> restart_policy.Classification:
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

    def _monitor(self, child: process.Child, launch_id: str) -> _Ended:
        ended = _Ended(returncode=0)
        reader = _LaunchBeats(self.hb_dir, launch_id)
        next_check = time.monotonic() + self.cfg.poll_s
        gone: list[detectors.DeadRank] = []  # ranks seen vanished without an exit code, not yet dead
        gone_since: dict[int, float] = {}
        save_seen: dict[int, int] = {}
        while True:
            rc = child.poll()
            if rc is not None:
                ended.detected = time.time()
                # The ranks' last word (a save that worked again just before the end) is logged too.
                self._report_saves(detectors.launch_heartbeats(reader.read(), launch_id), save_seen)
                ended.returncode = rc
                if rc != 0:  # they did not exit cleanly after all; the first to vanish first
                    ended.dead = sorted(gone, key=lambda d: (gone_since.get(d.rank, 0.0), d.rank))
                return ended
            if self.stop_signal is not None:
                ended.stop_signal = self.stop_signal
                name = signal.Signals(self.stop_signal).name
                grace = self.cfg.stop_grace_s or self.cfg.kill_grace_s
                self.log.emit(EventName.STOP, f"received {name}: stopping the child (grace {grace:g}s)")
                self.log.emit(EventName.KILL, child.kill(grace), unreaped=child.unreaped)
                ended.returncode = child.returncode()
                return ended
            if self.preempt_pending:
                ended.preempted = True
                self.preempt_pending = not self._forward_preemption(child, launch_id)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.cfg.poll_s
                snaps = reader.read()
                beats = detectors.launch_heartbeats(snaps, launch_id)
                save_seen = self._report_saves(beats, save_seen)
                self._track_recovery(beats, self.state.launch_count)
                self._keep_standby(child, beats)
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
                    ended.dead, ended.detected = dead, time.time()
                    self.log.emit(
                        EventName.RANK_DIED,
                        "; ".join(d.reason for d in dead) + ": killing the rest of the launch",
                        ranks=[d.rank for d in dead],
                    )
                    self.log.emit(EventName.KILL, child.kill(DEAD_RANK_KILL_GRACE_S), unreaped=child.unreaped)
                    ended.returncode = child.returncode()
                    return ended
                # While a vanished rank is being judged (dead, or a clean exit), its silence is no
                # hang. Either is judged when due (the grace, a timeout), not a poll interval later.
                hangs, due = (
                    self._check_hangs(child, launch_id, snaps, beats) if not gone else ([], SIGNAL_POLL_S)
                )
                next_check = min(next_check, time.monotonic() + due)
                if hangs:
                    ended.detected = time.time()
                    ended.hangs = hangs = self._where_blocked(child, hangs)
                    ended.culprit = self._handle_hang(child, hangs, launch_id, ended.detected)
                    ended.returncode = child.returncode()
                    return ended
            time.sleep(SIGNAL_POLL_S)

    def _errored(self, launch_id: str, beats: list[Heartbeat]) -> set[int]:
        """This host's ranks that wrote torchelastic's error file: they ended by an exception."""
        local = rootcause.errored_local_ranks(RunDir.of(self.cfg.root).elastic_logs(launch_id))
        return {b.rank for b in beats if b.host == self.host and b.local_rank in local}

    def _report_saves(self, beats: list[Heartbeat], seen: dict[int, int]) -> dict[int, int]:
        """save_failed / save_recovered events for what this node's ranks report."""
        news, seen = detectors.save_news((b for b in beats if b.host == self.host), seen)
        for n in news:
            self.log.emit(
                n.event,
                n.msg,
                rank=n.ranks[0],
                ranks=list(n.ranks),
                step=n.step,
                save_failures=n.failures,
                last_error=n.last_error,
            )
        return seen

    def _forward_preemption(self, child: process.Child, launch_id: str) -> bool:
        """Send the notice (SIGUSR1 unless --notice-signal) to this launch's ranks on this host;
        True once delivered. Ranks still in
        startup may not handle it yet (its default action kills), so the notice waits for them;
        a command that writes no heartbeat gets it, after --preempt-fallback seconds, on its
        ranks (process.Child.workers: never torchrun's agent, which SIGUSR1 would kill, nor a
        rank's DataLoader workers)."""
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
        self.log.emit(EventName.PREEMPT, f"preemption notice ({name}) forwarded to {who}", pids=pids)
        return True

    def _check_hangs(
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
        clock = liveness.Clock(time.time(), time.monotonic(), boot_id())
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

    def _where_blocked(self, child: process.Child, hangs: list[Hang]) -> list[Hang]:
        """Each hung rank with the file syscall /proc shows it blocked in (a read that never
        returns writes no heartbeat and no stack dump: this names its path)."""
        tree = set(child.tree())
        out = []
        for h in hangs:
            where = process.where_blocked(h.pid) if h.pid in tree else ""
            if where:
                h = replace(h, blocked=where)
                self.log.emit(
                    EventName.BLOCKED_IO,
                    f"rank {h.rank} (pid {h.pid}) is blocked in {where}",
                    rank=h.rank,
                    pid=h.pid,
                    phase=h.label,
                    io_path=h.io_path,
                    blocked=where,
                )
            out.append(h)
        return out

    def _handle_hang(self, child: process.Child, hangs: list[Hang], launch_id: str, detected: float) -> str:
        """Dump every local rank's stacks, name the culprit from where each rank waits (culprit.py),
        log it with the dumps, then kill the launch. Returns who hung it, for the launch's reason."""
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
            EventName.HANG,
            "; ".join(h.reason for h in hangs) + (f"; {who}" if who else ""),
            ranks=[h.rank for h in hangs],
            stopped_ranks=sorted(r for r, pid in targets.items() if pid in stopped),
            stopped_pids=sorted(stopped),
            detected=round(detected, 3),  # the verdict's time; the event's is after the dumps
            **diag.fields(),
        )
        for rank, pid in sorted(targets.items()):
            text = dumps.get(rank)
            msg = f"stack dump of rank {rank} (pid {pid}), from {paths[rank]}"
            if text is None:
                msg = f"rank {rank} (pid {pid}) wrote no stack dump within {self.cfg.dump_wait_s:g}s"
            self.log.emit(EventName.STACK_DUMP, msg, rank=rank, pid=pid, path=str(paths[rank]), stacks=text)
        note = child.kill(self.cfg.kill_grace_s)
        self.log.emit(
            EventName.KILL, f"hung launch killed: {note}", sigkilled=child.sigkilled, unreaped=child.unreaped
        )
        return "; ".join(f"culprit {f.describe()}" for f in diag.culprits) or who


class _LaunchBeats:
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


def failed_at(ended: _Ended, beats: list[Heartbeat]) -> dict[Moment, float]:
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

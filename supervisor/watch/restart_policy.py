"""The watchdog's decisions as pure functions over frozen snapshots; time is always passed in.

Nothing here touches a process or a file: classify how a launch ended, find hung ranks in
heartbeat snapshots, and decide stop / relaunch (budget, no progress, backoff). The loop in
``watch.py`` gathers the facts and carries out the decision.
"""

from __future__ import annotations

import signal
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import Protocol

from supervisor.format.eventnames import EventName
from supervisor.format.exitcodes import NON_RETRYABLE, Exit
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase
from supervisor.options import POSITIVE, nested, option

# Phase timeouts: seconds a rank may go without a heartbeat, i.e. without progress (beats are
# driven by progress: steps, or bytes in the long I/O phases). Train is the tight one; startup
# covers a cold start (imports, rendezvous); the I/O phases beat per chunk of bytes, so their
# timeouts bound a stall, not the size of a checkpoint.
DEFAULT_TRAIN_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_VERIFY_TIMEOUT_S = 300.0
DEFAULT_DOWNLOAD_TIMEOUT_S = 300.0
DEFAULT_LOAD_TIMEOUT_S = 600.0
DEFAULT_SAVE_TIMEOUT_S = 900.0
DEFAULT_COMMIT_TIMEOUT_S = 300.0
DEFAULT_DIGEST_TIMEOUT_S = 300.0
# Learned train timeout (as NVIDIA resiliency-ext, off unless --learn-hang-timeout FACTOR): max
# observed step time x factor, never below the floor (it covers the heartbeat writer's throttle).
DEFAULT_LEARN_FLOOR_S = 10.0
# Backoff between relaunches after failures (the first relaunch after progress is immediate).
DEFAULT_BACKOFF_INITIAL_S = 1.0
DEFAULT_BACKOFF_MAX_S = 300.0
DEFAULT_BACKOFF_JITTER_S = 1.0
# Budget: failed launches relaunched in total, and within a sliding window.
DEFAULT_MAX_RESTARTS = 100
DEFAULT_MAX_RESTARTS_PER_WINDOW = 20
DEFAULT_WINDOW_S = 3600.0
# No progress: this many failed launches in a row without a newer committed checkpoint.
DEFAULT_NO_PROGRESS_LAUNCHES = 3


class Outcome(str, Enum):
    DONE = "done"
    REQUEUE = "requeue"
    NON_RETRYABLE = "non_retryable"
    CRASH = "crash"
    HANG = "hang"
    STORAGE = "storage"  # a rank exited 74: storage failed beyond the trainer's policy
    STOPPED = "stopped"  # the watchdog itself was told to stop (SIGTERM/SIGINT)


FAILURES = frozenset({Outcome.CRASH, Outcome.HANG, Outcome.STORAGE})


@dataclass(frozen=True)
class Classification:
    outcome: Outcome
    code: int | None
    reason: str


def describe_returncode(returncode: int) -> str:
    """'exit 1' or 'killed by SIGKILL' (Popen reports death by signal as a negative code)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def classify_exit(returncode: int, rank_exit_codes: Iterable[int | None]) -> Classification:
    """How a launch ended. torchrun exits 1 for any failed worker, so the ranks' own exit codes
    (from this launch's heartbeats) decide; a non-retryable code on any rank wins, then requeue."""
    how = describe_returncode(returncode)
    if returncode == 0:
        return Classification(Outcome.DONE, 0, "exit 0: training finished")
    codes = {c for c in rank_exit_codes if c is not None}
    if returncode > 0:
        codes.add(returncode)
    bad = sorted(c for c in codes if c in NON_RETRYABLE)
    if bad:
        name = Exit(bad[0]).name
        return Classification(
            Outcome.NON_RETRYABLE, bad[0], f"{how}; a rank exited {bad[0]} ({name}): not retryable"
        )
    if Exit.REQUEUE in codes:
        return Classification(
            Outcome.REQUEUE, int(Exit.REQUEUE), f"{how}; checkpointed and asked to be relaunched (75)"
        )
    if Exit.STORAGE in codes:
        return Classification(
            Outcome.STORAGE,
            int(Exit.STORAGE),
            f"{how}; a rank exited 74 (STORAGE): storage failed beyond the trainer's policy, "
            "committed checkpoints intact",
        )
    return Classification(Outcome.CRASH, returncode, f"{how}: crash")


# ---------------------------------------------------------------- hang detection


def _timeout(default: float, what: str, flag: str) -> float:
    """A phase's timeout field, and its ``watch`` flag."""
    return option(f"seconds without progress in {what}", default, flag=flag, check=POSITIVE)


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds without progress allowed in each phase (field names are Phase values)."""

    train: float = _timeout(DEFAULT_TRAIN_TIMEOUT_S, "the train phase (a step)", "--hang-timeout")
    startup: float = _timeout(
        DEFAULT_STARTUP_TIMEOUT_S,
        "startup (imports, rendezvous, building the model), or before any heartbeat",
        "--startup-timeout",
    )
    verify: float = _timeout(
        DEFAULT_VERIFY_TIMEOUT_S, "verify (checking a checkpoint's files)", "--verify-timeout"
    )
    download: float = _timeout(
        DEFAULT_DOWNLOAD_TIMEOUT_S, "download (from the remote tier)", "--download-timeout"
    )
    load: float = _timeout(DEFAULT_LOAD_TIMEOUT_S, "load (reading a checkpoint)", "--load-timeout")
    save: float = _timeout(DEFAULT_SAVE_TIMEOUT_S, "save (writing a checkpoint)", "--save-timeout")
    commit: float = _timeout(DEFAULT_COMMIT_TIMEOUT_S, "commit (fsync, manifest, rename)", "--commit-timeout")
    digest: float = _timeout(
        DEFAULT_DIGEST_TIMEOUT_S, "digest (the final parameter digest)", "--digest-timeout"
    )

    def for_phase(self, phase: Phase) -> float | None:
        """Seconds a rank may stay silent in ``phase``; None: never hung (it is done)."""
        return None if phase == Phase.DONE else getattr(self, phase.value)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> PhaseTimeouts:
        """Timeouts as a state file recorded them; unknown names are ignored, missing ones default,
        a value that is not a positive number is a ValueError."""
        known = {f.name for f in fields(cls)}
        out: dict[str, float] = {}
        for k, v in d.items():
            if k in known:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                    raise ValueError(f"timeout '{k}' is {v!r}, not a positive number")
                out[k] = float(v)
        return cls(**out)


def learned_train_timeout(step_times: Iterable[float], factor: float, floor: float) -> float | None:
    """max observed step time x factor, at least ``floor``; None before any step was seen."""
    seen = [t for t in step_times if t > 0]
    return max(floor, max(seen) * factor) if seen else None


def effective_timeouts(base: PhaseTimeouts, learned_train: float | None) -> PhaseTimeouts:
    """Use the learned train timeout once there is one."""
    if learned_train is None:
        return base
    return replace(base, train=learned_train)


class Stamped(Protocol):
    """Something written at a time: a heartbeat, a node summary."""

    @property
    def wall_time(self) -> float: ...
    @property
    def mono_time(self) -> float: ...
    @property
    def boot_id(self) -> str: ...


@dataclass(frozen=True)
class Clock:
    """The watchdog's "now". A heartbeat written on this host during this boot is aged on the
    monotonic clock (an NTP step or a wall-clock jump must not fake a hang or hide one); one from
    another host, or an old one without ``mono_time``, on wall time."""

    wall: float
    mono: float = 0.0
    boot_id: str = ""

    def age(self, hb: Stamped) -> float:
        if self.boot_id and hb.boot_id == self.boot_id and hb.mono_time > 0:
            return self.mono - hb.mono_time
        return self.wall - hb.wall_time


def rank_stale(hb: Heartbeat, age: float, limit: float | None, current: Collection[str]) -> tuple[bool, str]:
    """Whether a rank needs a look for its silence, and the note that says why: from an earlier
    launch than the current ones, or silent past its phase's timeout (a finished rank never)."""
    old_launch = bool(current) and hb.launch_id not in current
    stale = hb.phase != Phase.DONE and (old_launch or (limit is not None and age > limit))
    note = "from an earlier launch" if old_launch else (f"silent > {limit:g}s" if stale else "")
    return stale, note


def describe_progress(progress: int, total: int, io_path: str) -> str:
    """'45% at step_00000120/__1_0.distcp' (a count where the total is unknown); '' when the
    heartbeat carries neither."""
    parts = []
    if total > 0:
        parts.append(f"{100 * progress // total}%")
    elif progress > 0:
        parts.append(f"{progress} done")
    if io_path:
        parts.append(f"at {io_path}")
    return " ".join(parts)


@dataclass(frozen=True)
class Hang:
    rank: int | None  # None: the launch as a whole (no heartbeat at all yet)
    pid: int | None
    phase: Phase
    step: int
    silent_s: float
    timeout_s: float
    progress: int = 0
    progress_total: int = 0
    io_path: str = ""  # the file the heartbeat says it was reading or writing
    blocked: str = ""  # what /proc says it is blocked in (launcher.blocked_io), filled in by watch

    @property
    def reason(self) -> str:
        who = "no rank" if self.rank is None else f"rank {self.rank}"
        where = describe_progress(self.progress, self.progress_total, self.io_path)
        return (
            f"{who} made no progress for {self.silent_s:.1f}s in phase {self.phase.value} at step "
            f"{self.step} (timeout {self.timeout_s:g}s{'; ' + where if where else ''})"
            + (f"; blocked in {self.blocked}" if self.blocked else "")
        )


def launch_heartbeats(snapshots: Iterable[HeartbeatSnapshot], launch_id: str) -> list[Heartbeat]:
    """Heartbeats written during this launch; older ones are stale and say nothing about it."""
    return [s.heartbeat for s in snapshots if s.heartbeat is not None and s.heartbeat.launch_id == launch_id]


def detect_hangs(
    snapshots: Sequence[HeartbeatSnapshot],
    *,
    launch_id: str,
    launch_age_s: float,
    clock: Clock,
    timeouts: PhaseTimeouts,
) -> list[Hang]:
    """Ranks of this launch without progress for longer than their phase allows (beats follow
    progress, so a long phase that progresses is never a hang). Before any rank of this launch
    has beaten, the launch itself is hung once older than the startup timeout (a rendezvous or
    ``init_process_group`` that never returns); ``launch_age_s`` is on the monotonic clock."""
    beats = launch_heartbeats(snapshots, launch_id)
    if not beats:
        if launch_age_s > timeouts.startup:
            return [Hang(None, None, Phase.STARTUP, 0, launch_age_s, timeouts.startup)]
        return []
    hangs = []
    for hb in beats:
        limit = timeouts.for_phase(hb.phase)
        silent = clock.age(hb)
        if limit is not None and silent > limit:
            hangs.append(
                Hang(
                    hb.rank,
                    hb.pid,
                    hb.phase,
                    hb.step,
                    silent,
                    limit,
                    hb.progress,
                    hb.progress_total,
                    hb.io_path,
                )
            )
    return hangs


@dataclass(frozen=True)
class DeadRank:
    rank: int
    pid: int
    step: int

    @property
    def reason(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) died at step {self.step} without an exit code"


def dead_ranks(beats: Iterable[Heartbeat], host: str, live_pids: Collection[int]) -> list[DeadRank]:
    """Ranks of this launch on ``host`` whose process is gone without recording an exit code:
    a crash, or a clean exit whose last heartbeat could not be written (a full disk); see
    ``confirm_dead``. Seeing it here, rather than waiting for torchrun to notice and then wait out
    its own shutdown of the surviving ranks (up to 30 s), is what makes a restart start at once."""
    return [
        DeadRank(b.rank, b.pid, b.step)
        for b in beats
        if b.host == host and b.exit_code is None and b.phase != Phase.DONE and b.pid not in live_pids
    ]


def confirm_dead(
    gone: Sequence[DeadRank],
    first_seen: Mapping[int, float],
    now: float,
    *,
    survivors: bool,
    grace_s: float,
    all_gone_wait_s: float,
) -> tuple[list[DeadRank], dict[int, float]]:
    """Which of the ranks seen ``gone`` are dead, and when each was first seen gone (keep it for
    the next call; ``now`` monotonic). A rank that exited 0 without its final heartbeat is not a
    death: its launched command will exit 0. So a vanished rank counts as dead only once no rank
    has vanished for ``grace_s`` while others still run (they wait for it in a collective:
    killing them at once is what keeps a restart fast); when no local rank is left, nobody needs
    rescuing, and the launched command's exit code is waited for up to ``all_gone_wait_s``. The
    dead are listed first-vanished first: the others may have died of it."""
    seen = {d.rank: first_seen.get(d.rank, now) for d in gone}
    if not gone:
        return [], seen
    quiet = now - max(seen.values())
    first = sorted(gone, key=lambda d: (seen[d.rank], d.rank))  # the first to vanish: the likely cause
    return (first if quiet >= (grace_s if survivors else all_gone_wait_s) else []), seen


@dataclass(frozen=True)
class SaveNews:
    """A change in the save failures ranks report: ``failures`` > 0 failed, 0 recovered; ``step``
    is the heartbeat's when the change was seen (the save's own step is in ``last_error``)."""

    ranks: tuple[int, ...]
    step: int
    failures: int
    last_error: str

    @property
    def event(self) -> EventName:
        return EventName.SAVE_FAILED if self.failures else EventName.SAVE_RECOVERED

    @property
    def msg(self) -> str:
        who = f"rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}"
        if self.failures:
            return (
                f"{who}: a save failed ({self.failures} in a row, reported at step {self.step}): "
                f"{self.last_error}; training goes on, the last committed checkpoint stands"
            )
        return f"{who}: saves work again (reported at step {self.step})"


def save_news(beats: Iterable[Heartbeat], seen: Mapping[int, int]) -> tuple[list[SaveNews], dict[int, int]]:
    """News since ``seen`` (rank -> save_failures last reported): ranks whose count rose, and
    ranks back at 0, grouped by what they say (every rank reports the same agreed failure)."""
    groups: dict[tuple[int, int, str], list[int]] = {}
    now = dict(seen)
    for b in beats:
        before = seen.get(b.rank, 0)
        if b.save_failures != before:
            now[b.rank] = b.save_failures
            if b.save_failures > before or b.save_failures == 0:
                err = b.last_error if b.save_failures else ""
                groups.setdefault((b.step, b.save_failures, err), []).append(b.rank)
    news = [SaveNews(tuple(sorted(r)), step, n, err) for (step, n, err), r in sorted(groups.items())]
    return news, now


# ---------------------------------------------------------------- restart decisions


@dataclass(frozen=True)
class LaunchRecord:
    """What one launch did, as kept in state.json for the budget and no-progress checks."""

    number: int
    launch_id: str
    started: float
    ended: float
    outcome: Outcome
    reason: str
    resumed_from: int | None  # newest committed checkpoint step when it started
    newest_after: int | None  # newest committed checkpoint step when it ended
    last_step: int | None  # where it died: lowest step among its unfinished ranks

    @property
    def progressed(self) -> bool:
        return self.newest_after is not None and (
            self.resumed_from is None or self.newest_after > self.resumed_from
        )


@dataclass(frozen=True)
class Budget:
    max_restarts: int = option("failed launches, total", DEFAULT_MAX_RESTARTS)
    per_window: int = option(
        "failed launches within --window", DEFAULT_MAX_RESTARTS_PER_WINDOW, flag="--max-restarts-per-window"
    )
    window_s: float = option("rate window in seconds", DEFAULT_WINDOW_S, flag="--window")


@dataclass(frozen=True)
class Backoff:
    initial_s: float = option(
        "seconds to wait after the 2nd failed launch in a row (none after the 1st), doubled after each further one",
        DEFAULT_BACKOFF_INITIAL_S,
        flag="--backoff-initial",
    )
    max_s: float = option("the longest wait between relaunches", DEFAULT_BACKOFF_MAX_S, flag="--backoff-max")
    jitter_s: float = option(
        "up to this many random seconds added to each wait", DEFAULT_BACKOFF_JITTER_S, flag="--backoff-jitter"
    )


@dataclass(frozen=True)
class RestartPolicy:
    budget: Budget = nested(Budget)
    no_progress_launches: int = option(
        "stop after K failed launches in a row without a newer checkpoint (0: never)",
        DEFAULT_NO_PROGRESS_LAUNCHES,
        flag="--no-progress",
        metavar="K",
    )
    backoff: Backoff = nested(Backoff)
    requeue_exit: bool = option("after a preemption checkpoint, exit 13", False)


@dataclass(frozen=True)
class Decision:
    relaunch: bool
    exit_code: int  # the watchdog's exit code when not relaunching
    wait_s: float
    reason: str
    counts_as_restart: bool = False


def backoff_s(failures_in_a_row: int, b: Backoff) -> float:
    """Wait before relaunching after the n-th failure in a row without progress: none after the
    first (a lone crash costs no time), then exponential with jitter via tenacity."""
    if failures_in_a_row <= 1:
        return 0.0
    import tenacity  # here, not at the top: `supervisor status` imports this module and needs speed

    wait = tenacity.wait_exponential_jitter(initial=b.initial_s, max=b.max_s, jitter=b.jitter_s)
    # a bare call state (no Retrying behind it): the wait strategy reads only attempt_number
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = failures_in_a_row - 1
    return float(wait(state))


def failures_in_a_row(history: Sequence[LaunchRecord]) -> int:
    """Failed launches at the end of the history since the last one that made progress."""
    n = 0
    for rec in reversed(history):
        if rec.outcome not in FAILURES or rec.progressed:
            break
        n += 1
    return n


def budget_verdict(restart_times: Sequence[float], now: float, b: Budget) -> str | None:
    """Why one more restart would exceed the budget, or None when it fits."""
    if len(restart_times) >= b.max_restarts:
        return (
            f"restart budget exhausted: {len(restart_times)} restarts done, --max-restarts {b.max_restarts}"
        )
    recent = [t for t in restart_times if now - t < b.window_s]
    if len(recent) >= b.per_window:
        return (
            f"restart rate exceeded: {len(recent)} restarts in the last {b.window_s:g}s, "
            f"limit {b.per_window} (--max-restarts-per-window)"
        )
    return None


def no_progress_verdict(history: Sequence[LaunchRecord], k: int) -> str | None:
    """A verdict naming the step when the last ``k`` launches all failed without committing a
    newer checkpoint, or all died at the same step."""
    if k <= 0 or len(history) < k:
        return None
    tail = history[-k:]
    if any(r.outcome not in FAILURES for r in tail):
        return None
    steps = {r.last_step for r in tail}
    if len(steps) == 1 and None not in steps:
        step = tail[-1].last_step
        return (
            f"no progress: the last {k} launches each died at step {step} "
            f"({tail[-1].reason}); the run cannot get past step {step}"
        )
    if not any(r.progressed for r in tail):
        base = tail[-1].resumed_from
        where = "from scratch" if base is None else f"from step {base}"
        return (
            f"no progress: the last {k} launches ended without committing a newer checkpoint "
            f"(resumed {where}, last died {where_died(tail[-1].last_step)}: {tail[-1].reason})"
        )
    return None


def where_died(step: int | None) -> str:
    return "before its first heartbeat" if step is None else f"at step {step}"


def decide(
    last: LaunchRecord,
    history: Sequence[LaunchRecord],
    restart_times: Sequence[float],
    now: float,
    policy: RestartPolicy,
    *,
    preempted: bool = False,
    stop_signal: int | None = None,
) -> Decision:
    """Stop or relaunch after ``last`` ended; ``history`` includes ``last`` as its final item."""
    code = last.outcome
    if stop_signal is not None:
        if code == Outcome.REQUEUE and policy.requeue_exit:
            return Decision(
                False, Exit.REQUEUE_REQUESTED, 0, "stopped by signal; child checkpointed: requeue"
            )
        name = signal.Signals(stop_signal).name
        return Decision(False, 128 + stop_signal, 0, f"watchdog received {name}: stopped")
    if code == Outcome.DONE:
        return Decision(False, Exit.OK, 0, "training finished")
    if code == Outcome.NON_RETRYABLE:
        return Decision(False, Exit.CHILD_NONRETRYABLE, 0, f"not relaunching: {last.reason}")
    if code == Outcome.REQUEUE:
        if preempted and policy.requeue_exit:
            return Decision(
                False, Exit.REQUEUE_REQUESTED, 0, "preempted and checkpointed: handing over to requeue"
            )
        return Decision(True, Exit.OK, 0, "checkpointed on request: relaunching at once")
    verdict = no_progress_verdict(history, policy.no_progress_launches)
    if verdict and all(r.outcome == Outcome.STORAGE for r in history[-policy.no_progress_launches :]):
        return Decision(
            False,
            Exit.STORAGE_UNAVAILABLE,
            0,
            f"storage unavailable: {verdict}; committed checkpoints are intact, requeue once the "
            "storage is back",
        )
    if verdict:
        return Decision(False, Exit.NO_PROGRESS, 0, verdict)
    verdict = budget_verdict(restart_times, now, policy.budget)
    if verdict:
        return Decision(False, Exit.BUDGET_EXHAUSTED, 0, verdict)
    n = failures_in_a_row(history)
    wait = backoff_s(n, policy.backoff)
    return Decision(
        True, Exit.OK, wait, f"{last.reason}: relaunch #{len(restart_times) + 1} in {wait:.1f}s", True
    )

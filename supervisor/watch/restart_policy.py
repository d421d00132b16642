"""The watchdog's restart decisions as pure functions; time is always passed in.

Nothing here touches a process or a file: classify how a launch ended and decide stop / relaunch
(budget, no progress, backoff). The loop in ``loop.py`` gathers the facts (the detectors in
``detectors.py`` find hung and dead ranks) and carries out the decision.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from supervisor import backoff
from supervisor.format.exitcodes import NON_RETRYABLE, Exit
from supervisor.format.launches import FAILURES, LaunchRecord, Outcome
from supervisor.options import nested, option

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


@dataclass(frozen=True)
class Classification:
    outcome: Outcome
    code: int | None
    reason: str


def _signal_name(signum: int) -> str:
    """'SIGKILL'; ValueError for a number that names no signal."""
    return signal.Signals(signum).name


def describe_returncode(returncode: int) -> str:
    """'exit 1' or 'killed by SIGKILL' (Popen reports death by signal as a negative code)."""
    if returncode < 0:
        try:
            return f"killed by {_signal_name(-returncode)}"
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

    def schedule(self) -> backoff.Backoff:
        return backoff.Backoff(self.initial_s, self.max_s, jitter_s=self.jitter_s)


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
    first (a lone crash costs no time), then exponential with up to ``jitter_s`` added."""
    return b.schedule().wait_s(failures_in_a_row - 1)


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
        name = _signal_name(stop_signal)
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

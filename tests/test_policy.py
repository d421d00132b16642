"""Every watchdog decision as a pure function: no process, no file, time passed in."""

from __future__ import annotations

import signal

import pytest

from supervisor.exitcodes import Exit
from supervisor.heartbeat import Heartbeat, HeartbeatSnapshot, Phase
from supervisor.policy import (
    Backoff,
    Budget,
    LaunchRecord,
    Outcome,
    PhaseTimeouts,
    RestartPolicy,
    backoff_s,
    budget_verdict,
    classify_exit,
    dead_ranks,
    decide,
    detect_hangs,
    effective_timeouts,
    failures_in_a_row,
    learned_train_timeout,
    no_progress_verdict,
)

LID = "launch-b"
T0 = 1_000_000.0


def snap(rank: int, phase: Phase, wall: float, step: int = 10, launch: str = LID) -> HeartbeatSnapshot:
    hb = Heartbeat(rank, rank, "h", 100 + rank, step, phase, wall, launch_id=launch)
    return HeartbeatSnapshot(rank, f"rank_{rank}.json", hb)


def rec(
    n: int,
    outcome: Outcome = Outcome.CRASH,
    frm: int | None = 10,
    after: int | None = 10,
    died: int | None = 13,
):
    return LaunchRecord(n, f"id{n}", T0 + n, T0 + n + 0.5, outcome, "exit 1: crash", frm, after, died)


# ---------------------------------------------------------------- classification


@pytest.mark.parametrize(
    ("rc", "ranks", "outcome", "code"),
    [
        (0, [], Outcome.DONE, 0),
        (1, [None, None], Outcome.CRASH, 1),
        (-signal.SIGKILL, [], Outcome.CRASH, -signal.SIGKILL),
        (1, [75, 75], Outcome.REQUEUE, 75),
        (75, [], Outcome.REQUEUE, 75),
        (1, [None, 78], Outcome.NON_RETRYABLE, 78),
        (1, [75, 65], Outcome.NON_RETRYABLE, 65),  # non-retryable wins over requeue
        (2, [], Outcome.NON_RETRYABLE, 2),  # usage error of the command itself
        (1, [3], Outcome.CRASH, 1),
    ],
)
def test_classify_exit(rc, ranks, outcome, code):
    c = classify_exit(rc, ranks)
    assert (c.outcome, c.code) == (outcome, code)


def test_classify_names_signal_and_code():
    assert "SIGKILL" in classify_exit(-9, []).reason
    assert "BAD_CONFIG" in classify_exit(1, [78]).reason


# ---------------------------------------------------------------- hang detection per phase


def test_no_hang_while_fresh():
    snaps = [snap(0, Phase.TRAIN, T0), snap(1, Phase.TRAIN, T0 - 0.5)]
    assert (
        detect_hangs(snaps, launch_id=LID, launch_started=T0 - 5, now=T0 + 1, timeouts=PhaseTimeouts(train=2))
        == []
    )


def test_train_hang_names_rank_phase_step():
    snaps = [snap(0, Phase.TRAIN, T0 + 9), snap(1, Phase.TRAIN, T0, step=42)]
    hangs = detect_hangs(
        snaps, launch_id=LID, launch_started=T0 - 5, now=T0 + 10, timeouts=PhaseTimeouts(train=5)
    )
    assert [(h.rank, h.pid, h.phase, h.step) for h in hangs] == [(1, 101, Phase.TRAIN, 42)]
    assert "rank 1" in hangs[0].reason and "train" in hangs[0].reason and "42" in hangs[0].reason


@pytest.mark.parametrize("phase", [Phase.SAVE, Phase.LOAD, Phase.STARTUP])
def test_long_phase_is_not_a_train_hang(phase):
    """A save (or load, startup) 10x longer than the train timeout is no false alarm..."""
    t = PhaseTimeouts(train=1, startup=30, load=30, save=30)
    snaps = [snap(0, phase, T0)]
    assert detect_hangs(snaps, launch_id=LID, launch_started=T0, now=T0 + 10, timeouts=t) == []
    # ...but past its own timeout it is a hang of that phase.
    hangs = detect_hangs(snaps, launch_id=LID, launch_started=T0, now=T0 + 31, timeouts=t)
    assert [h.phase for h in hangs] == [phase]


def test_done_rank_never_hangs():
    snaps = [snap(0, Phase.DONE, T0)]
    assert detect_hangs(snaps, launch_id=LID, launch_started=T0, now=T0 + 1e6, timeouts=PhaseTimeouts()) == []


def test_stale_launch_heartbeats_ignored_until_startup_timeout():
    """An old launch's heartbeat says nothing about this one; with no heartbeat of this launch,
    the launch is hung once past the startup timeout (a rendezvous that never returns)."""
    snaps = [
        snap(0, Phase.TRAIN, T0 - 1000, launch="launch-a"),
        HeartbeatSnapshot(1, "x", None, "not valid JSON"),
    ]
    t = PhaseTimeouts(train=1, startup=20)
    assert detect_hangs(snaps, launch_id=LID, launch_started=T0, now=T0 + 19, timeouts=t) == []
    hangs = detect_hangs(snaps, launch_id=LID, launch_started=T0, now=T0 + 21, timeouts=t)
    assert len(hangs) == 1 and hangs[0].rank is None and hangs[0].phase == Phase.STARTUP
    assert "no rank" in hangs[0].reason


def test_learned_timeout():
    assert learned_train_timeout([], 5, 10) is None
    assert learned_train_timeout([0.1, 0.3, 0.2], 5, 10) == 10  # floor
    assert learned_train_timeout([1.0, 4.0], 5, 10) == 20
    t = effective_timeouts(PhaseTimeouts(train=120, save=900), 20)
    assert (t.train, t.save) == (20, 900)
    assert effective_timeouts(PhaseTimeouts(train=120), None).train == 120


# ---------------------------------------------------------------- backoff, budget, no progress


def test_backoff_first_failure_immediate_then_exponential_with_jitter():
    b = Backoff(initial_s=1, max_s=30, jitter_s=0.5)
    assert backoff_s(0, b) == backoff_s(1, b) == 0
    for n, base in [(2, 1), (3, 2), (4, 4), (5, 8)]:
        waits = [backoff_s(n, b) for _ in range(50)]
        assert all(base <= w <= base + 0.5 for w in waits), (n, waits[:3])
        assert len(set(waits)) > 1  # jitter
    assert backoff_s(50, b) == 30


def test_failures_in_a_row_reset_by_progress():
    assert failures_in_a_row([rec(1), rec(2)]) == 2
    assert failures_in_a_row([rec(1), rec(2, after=20), rec(3, frm=20, after=20)]) == 1
    assert failures_in_a_row([rec(1), rec(2, Outcome.REQUEUE)]) == 0


def test_budget_total_and_window():
    b = Budget(max_restarts=5, per_window=3, window_s=100)
    assert budget_verdict([], T0, b) is None
    assert budget_verdict([T0 - 500, T0 - 400, T0 - 10, T0 - 5], T0, b) is None
    assert "rate" in budget_verdict([T0 - 30, T0 - 10, T0 - 5], T0, b)
    assert "--max-restarts 5" in budget_verdict([T0 - 900 + i for i in range(5)], T0, b)


def test_no_progress_same_step_names_step():
    hist = [rec(1, died=37), rec(2, died=37), rec(3, died=37)]
    v = no_progress_verdict(hist, 3)
    assert v is not None and "step 37" in v
    assert no_progress_verdict(hist[:2], 3) is None


def test_no_progress_without_newer_checkpoint():
    hist = [rec(1, died=12), rec(2, died=14), rec(3, died=19)]
    v = no_progress_verdict(hist, 3)
    assert v is not None and "newer checkpoint" in v and "step 10" in v
    progressing = [
        rec(1, frm=10, after=15, died=17),
        rec(2, frm=15, after=15, died=18),
        rec(3, frm=15, died=19),
    ]
    assert no_progress_verdict(progressing, 3) is None
    assert no_progress_verdict([*hist[:2], rec(3, Outcome.REQUEUE)], 3) is None
    assert no_progress_verdict(hist, 0) is None


# ---------------------------------------------------------------- the decision


def test_decide_paths():
    p = RestartPolicy(budget=Budget(10, 10, 3600), no_progress_launches=3)
    done = rec(1, Outcome.DONE)
    assert (
        decide(done, [done], [], T0, p).exit_code == Exit.OK and not decide(done, [done], [], T0, p).relaunch
    )
    bad = rec(1, Outcome.NON_RETRYABLE)
    d = decide(bad, [bad], [], T0, p)
    assert (d.relaunch, d.exit_code) == (False, Exit.CHILD_NONRETRYABLE) and bad.reason in d.reason
    crash = rec(1)
    d = decide(crash, [crash], [], T0, p)
    assert d.relaunch and d.wait_s == 0 and d.counts_as_restart
    req = rec(1, Outcome.REQUEUE)
    d = decide(req, [req], [], T0, p)
    assert d.relaunch and not d.counts_as_restart and d.wait_s == 0


def test_decide_requeue_exit_only_after_preemption():
    p = RestartPolicy(requeue_exit=True)
    req = rec(1, Outcome.REQUEUE)
    assert decide(req, [req], [], T0, p, preempted=True).exit_code == Exit.REQUEUE_REQUESTED
    assert decide(req, [req], [], T0, p, preempted=False).relaunch
    assert decide(req, [req], [], T0, RestartPolicy(), preempted=True).relaunch


def test_decide_no_progress_before_budget():
    p = RestartPolicy(budget=Budget(2, 10, 3600), no_progress_launches=3)
    hist = [rec(1, died=5), rec(2, died=5), rec(3, died=5)]
    assert decide(hist[-1], hist, [T0, T0], T0, p).exit_code == Exit.NO_PROGRESS
    d = decide(hist[0], hist[:1], [T0, T0], T0, p)
    assert (d.relaunch, d.exit_code) == (False, Exit.BUDGET_EXHAUSTED)


def test_decide_stop_signal():
    st = rec(1, Outcome.STOPPED)
    d = decide(st, [st], [], T0, RestartPolicy(), stop_signal=signal.SIGTERM)
    assert (d.relaunch, d.exit_code) == (False, 128 + signal.SIGTERM)
    req = rec(1, Outcome.REQUEUE)
    d = decide(req, [req], [], T0, RestartPolicy(requeue_exit=True), stop_signal=signal.SIGTERM)
    assert d.exit_code == Exit.REQUEUE_REQUESTED


def test_dead_ranks_are_gone_without_exit_code():
    beats = [
        Heartbeat(0, 0, "h", 100, 7, Phase.TRAIN, T0),  # alive
        Heartbeat(1, 1, "h", 101, 7, Phase.TRAIN, T0),  # gone: crashed
        Heartbeat(2, 2, "h", 102, 7, Phase.TRAIN, T0, exit_code=75),  # gone after a deliberate exit
        Heartbeat(3, 3, "h", 103, 9, Phase.DONE, T0),  # finished
        Heartbeat(4, 0, "other", 104, 7, Phase.TRAIN, T0),  # another host: not ours to judge
    ]
    dead = dead_ranks(beats, "h", {100})
    assert [(d.rank, d.pid, d.step) for d in dead] == [(1, 101, 7)]
    assert "rank 1 (pid 101) died at step 7" in dead[0].reason


def test_phase_timeouts_from_a_state_file_round_trip_and_refuse_garbage() -> None:
    t = PhaseTimeouts(train=3, verify=40)
    assert PhaseTimeouts.from_dict(t.to_dict()) == t
    assert PhaseTimeouts.from_dict({"train": 7, "retired_phase": 1}) == PhaseTimeouts(train=7)
    for bad in ({"train": "x"}, {"load": 0}, {"save": True}):
        with pytest.raises(ValueError):
            PhaseTimeouts.from_dict(bad)

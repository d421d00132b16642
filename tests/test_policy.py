"""Every watchdog decision as a pure function: no process, no file, time passed in."""

from __future__ import annotations

import signal

import pytest

from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase
from supervisor.format.launches import LaunchRecord, Outcome
from supervisor.watch.detectors import (
    DeadRank,
    Hang,
    confirm_dead,
    dead_ranks,
    detect_hangs,
    gave_up,
    hang_due_s,
    launch_heartbeats,
    save_news,
)
from supervisor.watch.liveness import Clock, PhaseTimeouts, effective_timeouts, learned_train_timeout
from supervisor.watch.restart_policy import (
    Backoff,
    Budget,
    RestartPolicy,
    backoff_s,
    budget_verdict,
    classify_exit,
    decide,
    failures_in_a_row,
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
        (1, [74, None], Outcome.STORAGE, 74),  # storage failed beyond the trainer's policy: retryable
        (1, [74, 75], Outcome.REQUEUE, 75),  # ...but a checkpoint on request wins
        (1, [66, 74], Outcome.NON_RETRYABLE, 66),  # no usable checkpoint: not retryable
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
        detect_hangs(
            snaps,
            launch_id=LID,
            launch_age_s=6,
            clock=Clock(T0 + 1),
            timeouts=PhaseTimeouts(train=2),
        )
        == []
    )


def test_train_hang_names_rank_phase_step():
    snaps = [snap(0, Phase.TRAIN, T0 + 9), snap(1, Phase.TRAIN, T0, step=42)]
    hangs = detect_hangs(
        snaps,
        launch_id=LID,
        launch_age_s=15,
        clock=Clock(T0 + 10),
        timeouts=PhaseTimeouts(train=5),
    )
    assert [(h.rank, h.pid, h.phase, h.step) for h in hangs] == [(1, 101, Phase.TRAIN, 42)]
    assert "rank 1" in hangs[0].reason and "train" in hangs[0].reason and "42" in hangs[0].reason


@pytest.mark.parametrize("phase", [Phase.SAVE, Phase.LOAD, Phase.STARTUP])
def test_long_phase_is_not_a_train_hang(phase):
    """A save (or load, startup) 10x longer than the train timeout is no false alarm..."""
    t = PhaseTimeouts(train=1, startup=30, load=30, save=30)
    snaps = [snap(0, phase, T0)]
    assert detect_hangs(snaps, launch_id=LID, launch_age_s=10, clock=Clock(T0 + 10), timeouts=t) == []
    # ...but past its own timeout it is a hang of that phase.
    hangs = detect_hangs(snaps, launch_id=LID, launch_age_s=31, clock=Clock(T0 + 31), timeouts=t)
    assert [h.phase for h in hangs] == [phase]


def test_done_rank_never_hangs():
    snaps = [snap(0, Phase.DONE, T0)]
    assert (
        detect_hangs(
            snaps,
            launch_id=LID,
            launch_age_s=1e6,
            clock=Clock(T0 + 1e6),
            timeouts=PhaseTimeouts(),
        )
        == []
    )


def test_stale_launch_heartbeats_ignored_until_startup_timeout():
    """An old launch's heartbeat says nothing about this one; with no heartbeat of this launch and
    --require-heartbeat, the launch is hung once past the startup timeout (a rendezvous that never
    returns); without it, a command that writes no heartbeat is never hung by silence."""
    snaps = [
        snap(0, Phase.TRAIN, T0 - 1000, launch="launch-a"),
        HeartbeatSnapshot(1, "x", None, "not valid JSON"),
    ]
    t = PhaseTimeouts(train=1, startup=20)
    kw = {"launch_id": LID, "timeouts": t}
    assert detect_hangs(snaps, launch_age_s=1e6, clock=Clock(T0 + 1e6), **kw) == []
    kw["require_heartbeat"] = True
    assert detect_hangs(snaps, launch_age_s=19, clock=Clock(T0 + 19), **kw) == []
    hangs = detect_hangs(snaps, launch_age_s=21, clock=Clock(T0 + 21), **kw)
    assert len(hangs) == 1 and hangs[0].rank is None and hangs[0].phase == Phase.STARTUP
    assert "no rank" in hangs[0].reason


def test_clock_ages_own_boot_on_the_monotonic_clock():
    """Same boot: monotonic (a wall clock stepped an hour ahead fakes no hang, one stepped back
    hides none); another host or boot, or an old heartbeat without mono_time: wall time."""
    clock = Clock(wall=T0 + 3600, mono=500.0, boot_id="boot-a")
    mine = Heartbeat(0, 0, "h", 1, 5, Phase.TRAIN, T0, mono_time=498.0, boot_id="boot-a")
    assert clock.age(mine) == 2.0
    other_boot = Heartbeat(0, 0, "h", 1, 5, Phase.TRAIN, T0, mono_time=498.0, boot_id="boot-b")
    old = Heartbeat(0, 0, "h", 1, 5, Phase.TRAIN, T0)
    assert clock.age(other_boot) == clock.age(old) == 3600
    snaps = [HeartbeatSnapshot(0, "x", mine)]
    t = PhaseTimeouts(train=3)
    assert detect_hangs(snaps, launch_id="", launch_age_s=9, clock=clock, timeouts=t) == []
    later = Clock(wall=T0 - 100, mono=502.0, boot_id="boot-a")  # wall stepped back: still caught
    assert [h.rank for h in detect_hangs(snaps, launch_id="", launch_age_s=9, clock=later, timeouts=t)] == [0]


def test_a_hang_is_due_when_the_first_silent_rank_overstays_its_phase():
    """The watchdog checks again when a hang is due, not a poll interval later: the due time is
    the earliest rank's limit minus its silence (each by its own phase), and ``detect_hangs``
    finds that rank just after it and nobody just before it. Done ranks are never due."""
    t = PhaseTimeouts(train=2, save=10)
    snaps = [
        snap(0, Phase.TRAIN, T0 - 0.5),  # due in 1.5 s
        snap(1, Phase.SAVE, T0 - 9.0),  # due in 1.0 s: the first
        snap(2, Phase.TRAIN, T0),  # due in 2.0 s
        snap(3, Phase.DONE, T0 - 1e6),
    ]
    clock = Clock(T0)
    due = hang_due_s(launch_heartbeats(snaps, LID), clock, t)
    assert due == pytest.approx(1.0)

    def hung(at: float) -> list[int | None]:
        return [
            h.rank for h in detect_hangs(snaps, launch_id=LID, launch_age_s=60, clock=Clock(at), timeouts=t)
        ]

    assert hung(T0 + due - 0.01) == []
    assert hung(T0 + due + 0.01) == [1]
    assert hang_due_s(launch_heartbeats(snaps[3:], LID), clock, t) is None  # only a done rank
    assert hang_due_s([], clock, t) is None  # no heartbeat yet: the poll interval applies
    late = Clock(T0 + 5)  # already overdue: a negative due (the loop checks at once)
    assert hang_due_s(launch_heartbeats(snaps, LID), late, t) == pytest.approx(-4.0)


@pytest.mark.parametrize("phase", [Phase.VERIFY, Phase.DOWNLOAD, Phase.LOAD, Phase.COMMIT, Phase.DIGEST])
def test_long_io_phase_hangs_only_without_progress(phase):
    """Beats follow bytes: a rank deep in a long phase whose last beat is fresh is fine, however
    long the phase has run; one silent past the phase's timeout is a hang naming the file."""
    t = PhaseTimeouts(train=1, **{phase.value: 5})
    path = "step_00000120/__1_0.distcp"
    hb = Heartbeat(
        1, 1, "h", 101, 120, phase, T0, launch_id=LID, progress=45, progress_total=100, io_path=path
    )
    snaps = [HeartbeatSnapshot(1, "x", hb)]
    assert detect_hangs(snaps, launch_id=LID, launch_age_s=3600, clock=Clock(T0 + 4), timeouts=t) == []
    (h,) = detect_hangs(snaps, launch_id=LID, launch_age_s=3600, clock=Clock(T0 + 6), timeouts=t)
    assert (h.rank, h.phase, h.progress, h.progress_total, h.io_path) == (1, phase, 45, 100, path)
    for part in ("rank 1", f"phase {phase.value}", "step 120", "45%", path):
        assert part in h.reason, (part, h.reason)


def beating(
    rank: int, phase: Phase, wrote: float, advanced: float, waiting: str = "", **kw
) -> HeartbeatSnapshot:
    """A heartbeat written at ``wrote`` whose progress last changed at ``advanced`` (wall times)."""
    hb = Heartbeat(
        rank, rank, "h", 100 + rank, 20, phase, wrote, launch_id=LID, progress=423129,
        progress_wall=advanced, waiting=waiting, **kw,
    )  # fmt: skip
    return HeartbeatSnapshot(rank, f"rank_{rank}.json", hb)


@pytest.mark.parametrize("phase", [Phase.TRAIN, Phase.SAVE, Phase.COMMIT, Phase.LOAD, Phase.VERIFY])
def test_beats_without_progress_are_a_hang_after_the_phase_timeout(phase):
    """Issue 44: both ranks rewrote their heartbeats every second for ten minutes while nothing
    advanced (each waited for the other in a different collective), and no verdict came. Silence
    is measured from the last change of progress, not from the last write: past the phase's
    timeout it is a hang, of every rank, each waiting one saying what it waits for (waiting ranks
    are held to the launch's latest progress: rank 1's, here)."""
    t = PhaseTimeouts(train=20, save=20, commit=20, load=20, verify=20)
    snaps = [
        beating(0, phase, wrote=T0 + 30, advanced=T0, waiting="peers in DCP's exchanges", wait_until=T0 + 40),
        beating(1, phase, wrote=T0 + 30.5, advanced=T0 + 0.2, waiting="every rank's report of the save"),
    ]
    kw = {"launch_id": LID, "launch_age_s": 600, "timeouts": t}
    assert detect_hangs(snaps, clock=Clock(T0 + 19.9), **kw) == []
    assert hang_due_s(launch_heartbeats(snaps, LID), Clock(T0 + 10), t) == pytest.approx(10.2)
    hangs = detect_hangs(snaps, clock=Clock(T0 + 20.5), **kw)
    assert [(h.rank, h.silent_s) for h in hangs] == [(0, pytest.approx(20.3)), (1, pytest.approx(20.3))]
    assert f"rank 0 made no progress for 20.3s in phase {phase.value}" in hangs[0].reason
    assert (
        "waiting for peers in DCP's exchanges (gives up in 20s), beating without progress" in hangs[0].reason
    )
    assert "waiting for every rank's report of the save, beating" in hangs[1].reason
    # the same beats on the clock of their own boot: aged from progress_mono
    mono = Heartbeat(
        0, 0, "h", 1, 20, phase, T0, launch_id=LID, mono_time=990.0, boot_id="b", progress_mono=970.0
    )
    assert Clock(T0, mono=1000.0, boot_id="b").silence(mono) == pytest.approx(30.0)
    assert Clock(T0, mono=1000.0, boot_id="b").age(mono) == pytest.approx(10.0)


def test_a_waiting_rank_is_held_to_its_launchs_progress():
    """A rank done with its share that waits for the slowest is no hang while that one advances
    (however long), and is one with the others once nothing advances anywhere, but not named beside
    a rank stuck on its own (the one it waits for); a rank that does not say it waits is judged by
    its own progress alone."""
    t = PhaseTimeouts(load=5)
    waiter = beating(0, Phase.LOAD, wrote=T0 + 60, advanced=T0, waiting="peers in DCP's exchanges")
    slow = beating(1, Phase.LOAD, wrote=T0 + 59, advanced=T0 + 59)
    kw = {"launch_id": LID, "launch_age_s": 600, "timeouts": t}
    assert detect_hangs([waiter, slow], clock=Clock(T0 + 60), **kw) == []
    assert [h.rank for h in detect_hangs([waiter, slow], clock=Clock(T0 + 64.5), **kw)] == [1]
    quiet = beating(0, Phase.LOAD, wrote=T0 + 60, advanced=T0)  # beats, advances nothing, waits for nothing
    assert [h.rank for h in detect_hangs([quiet, slow], clock=Clock(T0 + 60), **kw)] == [0]
    stuck = beating(1, Phase.LOAD, wrote=T0, advanced=T0)  # silent in a read: the one to name
    assert [h.rank for h in detect_hangs([waiter, stuck], clock=Clock(T0 + 60), **kw)] == [1]


def test_a_rank_that_gave_up_waiting_for_its_peers_hangs_the_launch_at_once():
    """A save's exchanges give up at half the save/commit timeout (exit 76): the launch is hung
    then, not at the phase timeout. The verdict names the ranks the others waited for (running,
    waiting for nobody: rank 2, in its write), says who gave up and on what; when every rank left
    waits, they all stand for it; when none gave up, nothing."""
    t = PhaseTimeouts(save=20)
    quit0 = Heartbeat(
        0,
        0,
        "h",
        100,
        30,
        Phase.COMMIT,
        T0,
        launch_id=LID,
        exit_code=76,
        waiting="every rank's report of the save",
    )
    waiting1 = beating(1, Phase.SAVE, wrote=T0 + 9, advanced=T0, waiting="peers in DCP's exchanges").heartbeat
    stuck2 = Heartbeat(
        2,
        2,
        "h",
        102,
        30,
        Phase.SAVE,
        T0,
        launch_id=LID,
        io_path="step_00000030.tmp.x/__2_0.distcp",
        progress_wall=T0 - 1,
    )
    done3 = Heartbeat(3, 3, "h", 103, 30, Phase.DONE, T0, launch_id=LID)
    hangs, note = gave_up([quit0, waiting1, stuck2, done3], Clock(T0 + 10), t)
    assert note == "rank 0 gave up waiting for every rank's report of the save at step 30"
    assert [(h.rank, h.silent_s) for h in hangs] == [(2, pytest.approx(11.0))]
    assert "at step_00000030.tmp.x/__2_0.distcp" in hangs[0].reason
    hangs, _ = gave_up([quit0, waiting1], Clock(T0 + 10), t)
    assert [h.rank for h in hangs] == [1] and "waiting for peers in DCP's exchanges" in hangs[0].reason
    hangs, _ = gave_up([quit0], Clock(T0 + 10), t)
    assert [h.rank for h in hangs] == [0]
    assert gave_up([waiting1, stuck2], Clock(T0 + 10), t) == ([], "")


def test_a_heartbeat_without_progress_times_is_aged_by_its_writes():
    """A writer from before progress times: its beats are aged as they always were."""
    old = Heartbeat(0, 0, "h", 1, 5, Phase.SAVE, T0, launch_id=LID)
    assert Clock(T0 + 7).silence(old) == Clock(T0 + 7).age(old) == 7


def test_hang_reason_names_where_it_is_blocked():
    """What /proc saw (a read that never returns) is part of the verdict."""
    h = Hang(0, 7, Phase.LOAD, 10, 6.2, 5.0, io_path="step_00000010/x.distcp")
    assert "blocked" not in h.reason
    blocked = "read(/ckpt/run/step_00000010/x.distcp) (state D, wchan fuse_wait)"
    assert Hang(0, 7, Phase.LOAD, 10, 6.2, 5.0, blocked=blocked).reason.endswith(f"; blocked in {blocked}")


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


def test_a_vanished_rank_is_dead_only_after_a_quiet_grace_while_others_run():
    d0, d1 = DeadRank(0, 100, 7), DeadRank(1, 101, 7)
    kw = {"grace_s": 1.0, "all_gone_wait_s": 30.0}
    dead, seen = confirm_dead([d1], {}, 10.0, survivors=True, **kw)
    assert dead == [] and seen == {1: 10.0}
    dead, seen = confirm_dead([d1], seen, 10.9, survivors=True, **kw)
    assert dead == []
    assert confirm_dead([d1], seen, 11.0, survivors=True, **kw)[0] == [d1]
    # Another rank vanishing restarts the grace: ranks finishing together leave one by one.
    dead, seen = confirm_dead([d0, d1], seen, 10.8, survivors=True, **kw)
    assert dead == [] and seen == {0: 10.8, 1: 10.0}
    assert confirm_dead([d0, d1], seen, 11.5, survivors=True, **kw)[0] == []
    assert confirm_dead([d0, d1], seen, 11.8, survivors=True, **kw)[0] == [d1, d0]  # first gone first
    # Nobody left to rescue: the launched command's exit code decides, waited for longer.
    assert confirm_dead([d0, d1], seen, 20.0, survivors=False, **kw)[0] == []
    assert confirm_dead([d0, d1], seen, 41.0, survivors=False, **kw)[0] == [d1, d0]
    assert confirm_dead([], seen, 99.0, survivors=True, **kw) == ([], {})


def test_a_vanished_rank_that_recorded_its_exception_is_dead_at_once():
    """An error file (torchelastic's @record) says it was no clean exit: no grace, no waiting for
    the launched command's exit code; the first to vanish still comes first."""
    d0, d1 = DeadRank(0, 100, 7), DeadRank(1, 101, 7)
    kw = {"grace_s": 1.0, "all_gone_wait_s": 30.0}
    seen = {1: 10.0}
    assert confirm_dead([d0, d1], seen, 10.1, survivors=False, failed={0}, **kw)[0] == [d1, d0]
    assert confirm_dead([d1], {}, 10.0, survivors=True, failed={1}, **kw)[0] == [d1]
    assert confirm_dead([d1], {}, 10.0, survivors=True, failed={0}, **kw)[0] == []  # not a gone rank


def test_save_news_reports_rises_and_recoveries_once():
    def hb(rank: int, failures: int, err: str = "", step: int = 20) -> Heartbeat:
        return Heartbeat(
            rank, rank, "h", 100 + rank, step, Phase.TRAIN, T0, save_failures=failures, last_error=err
        )

    news, seen = save_news([hb(0, 0), hb(1, 0)], {})
    assert news == [] and seen == {}
    err = "ENOSPC (No space left on device): step_00000020.tmp"
    news, seen = save_news([hb(0, 1, err), hb(1, 1, err)], seen)
    assert [(n.event.NAME, n.ranks, n.step, n.failures, n.last_error) for n in news] == [
        ("save_failed", (0, 1), 20, 1, err)
    ]
    assert "ranks 0, 1" in news[0].msg and err in news[0].msg
    assert save_news([hb(0, 1, err), hb(1, 1, err)], seen)[0] == []  # nothing new
    news, seen = save_news([hb(0, 2, err, 25), hb(1, 1, err)], seen)  # rank 1 not updated yet
    assert [(n.ranks, n.failures) for n in news] == [((0,), 2)]
    news, seen = save_news([hb(0, 0, step=30), hb(1, 0, step=30)], seen)
    assert [(n.event.NAME, n.ranks) for n in news] == [("save_recovered", (0, 1))] and seen == {0: 0, 1: 0}


def test_decide_storage_failures_back_off_then_exit_14():
    p = RestartPolicy(backoff=Backoff(1, 30, 0), no_progress_launches=3)
    hist = [rec(1, Outcome.STORAGE, died=None)]
    d = decide(hist[-1], hist, [], T0, p)
    assert d.relaunch and d.counts_as_restart
    hist.append(rec(2, Outcome.STORAGE, died=None))
    d = decide(hist[-1], hist, [T0], T0, p)
    assert d.relaunch and d.wait_s == 1  # backoff, as after any failure in a row
    hist.append(rec(3, Outcome.STORAGE, died=None))
    d = decide(hist[-1], hist, [T0, T0], T0, p)
    assert (d.relaunch, d.exit_code) == (False, Exit.STORAGE_UNAVAILABLE)
    assert "storage" in d.reason and "newer checkpoint" in d.reason
    mixed = [rec(1, died=None), *hist[1:]]
    assert decide(mixed[-1], mixed, [T0, T0], T0, p).exit_code == Exit.NO_PROGRESS


def test_phase_timeouts_from_a_state_file_round_trip_and_refuse_garbage() -> None:
    t = PhaseTimeouts(train=3, verify=40)
    assert PhaseTimeouts.from_dict(t.to_dict()) == t
    assert PhaseTimeouts.from_dict({"train": 7, "retired_phase": 1}) == PhaseTimeouts(train=7)
    for bad in ({"train": "x"}, {"load": 0}, {"save": True}):
        with pytest.raises(ValueError):
            PhaseTimeouts.from_dict(bad)

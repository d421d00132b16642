"""The drill's plan and judge are pure: tested here on synthetic runs, without processes (and the
storage scenarios' phase clock on heartbeat files written as the trainer writes them)."""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from store_helpers import make_ckpt

from supervisor import store
from supervisor.cli.drill import chosen
from supervisor.drill import report
from supervisor.drill.corruption import DRILL
from supervisor.drill.judge import Case, StepRecord, StorageFacts, Verdict, find_resumes, judge
from supervisor.drill.plan import (
    CHAOS,
    DISK_FULL_FILL_WITHIN,
    DISK_FULL_INTERVALS,
    SCENARIOS,
    Fault,
    Kind,
    plan,
    steps_redone_bound,
)
from supervisor.drill.report import summary, verdict_table
from supervisor.drill.runner import ScenarioRun
from supervisor.drill.storage import PhaseClock, at_end, driver_for
from supervisor.format import eventtypes as ev
from supervisor.format.eventtypes import Logged
from supervisor.format.heartbeat import Heartbeat, Phase, write_heartbeat
from supervisor.format.statediff import Comparison, ItemDiff, StepDiff

STEPS, EVERY = 40, 10


def curve(launch: str, steps: range, lr_shift: float = 0.0, loss_shift: float = 0.0) -> list[StepRecord]:
    return [
        StepRecord(s, 3.0 - 0.02 * s + 0.01 * math.sin(s) + loss_shift, 1e-3 + lr_shift, launch)
        for s in steps
    ]


GOLDEN = curve("g", range(1, STEPS + 1))


def faithful_run(kill_at: int = 17, resume_from: int = 10) -> list[StepRecord]:
    """A kill at ``kill_at`` and a resume from ``resume_from`` that reproduces golden exactly."""
    return curve("a", range(1, kill_at + 1)) + curve("b", range(resume_from + 1, STEPS + 1))


def verdict(
    drill, *, faults=None, injected=None, in_flight=None, digest="d0", violations=(), scenario="kill9", **seen
):
    """judge() on a drill run against GOLDEN; ``seen``: events, fault_times, storage."""
    faults = faults if faults is not None else [Fault(Kind.KILL9, 17, 1)]
    injected = injected if injected is not None else faults
    run = ScenarioRun(
        scenario,
        Path(scenario),
        injected=list(injected),
        save_in_flight=list(in_flight if in_flight is not None else [False] * len(injected)),
        records=list(drill),
        digest=digest,
        latest_violations=list(violations),
        **seen,
    )
    return judge(Case(scenario, faults, run, GOLDEN, "d0", STEPS, EVERY))


def seen_after_fault(drill) -> list[StepRecord]:
    """The drill's records stamped as first seen: launch "a" before the fault at T0, "b" after."""
    return [StepRecord(r.step, r.loss, r.lr, r.launch, T0 + (30 if r.launch == "b" else -1)) for r in drill]


def failed(v) -> set[str]:
    return {c.name for c in v.checks if not c.ok}


def test_faithful_resume_passes():
    v = verdict(faithful_run())
    assert v.ok, v.failures()
    assert [(r.ckpt_step, r.reached, r.redone) for r in v.resumes] == [(10, 17, 7)]


def test_a_moving_average_that_did_not_resume_fails_the_digest_naming_both_parts():
    """The trainer keeps an EMA: the run's digest is "<params> ema <average>". Parameters equal
    and the average not (it was not restored) is a failed digest, and the line shows the parts."""
    params, ema, other = "a" * 64, "b" * 64, "c" * 64
    run = ScenarioRun(
        "kill9",
        Path("r"),
        injected=[Fault(Kind.KILL9, 17, 1)],
        records=faithful_run(),
        digest=f"{params} ema {other}",
    )
    v = judge(Case("kill9", [Fault(Kind.KILL9, 17, 1)], run, GOLDEN, f"{params} ema {ema}", STEPS, EVERY))
    (check,) = [c for c in v.checks if c.name == "final digest equals golden"]
    assert not check.ok
    assert check.detail == f"{params[:16]} ema {other[:16]} vs golden {params[:16]} ema {ema[:16]}"


def test_find_resumes_per_launch():
    recs = curve("a", range(1, 13)) + curve("b", range(11, 25)) + curve("c", range(25, 31))
    assert [(r.launch, r.ckpt_step, r.reached) for r in find_resumes(recs)] == [("b", 10, 12), ("c", 24, 24)]


def test_resume_that_restored_nothing_fails_with_reasons():
    """A relaunch that started over with a reset schedule and another trajectory."""
    drill = curve("a", range(1, 18)) + curve("b", range(11, STEPS + 1), lr_shift=5e-4, loss_shift=0.3)
    v = verdict(drill, digest="other")
    assert {"LR continuous", "loss continuous", "final digest equals golden"} <= failed(v)
    detail = {c.name: c.detail for c in v.checks}
    assert "step 11" in detail["LR continuous"]
    assert "at step" in detail["loss continuous"]


def test_too_many_steps_redone():
    v = verdict(faithful_run(kill_at=19, resume_from=0)[:19] + curve("b", range(1, STEPS + 1)))
    assert "steps redone within bound" in failed(v)


def test_save_in_flight_doubles_the_bound():
    drill = curve("a", range(1, 20)) + curve("b", range(6, STEPS + 1))
    assert "steps redone within bound" in failed(verdict(drill, in_flight=[False]))
    assert "steps redone within bound" not in failed(verdict(drill, in_flight=[True]))


def test_a_lost_preemption_checkpoint_names_what_ended_the_launch():
    """SIGTERM to every process of the job killed a DataLoader worker: the rank died of it before
    the step boundary that saves; the check says the checkpoint was lost and quotes the watchdog."""
    drill = seen_after_fault(curve("a", range(1, 19)) + curve("b", range(11, STEPS + 1)))
    end = (
        "launch 1 ended after 9.1s at step 18: rank 1 (pid 77) died at step 18 without an exit code; root "
        "cause rank 1: RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly (t.py:40)"
    )
    events = [
        logged(T0 - 5, end_of(1, "crash"), "an earlier launch"),
        logged(T0 + 2, end_of(2, "crash"), end),
    ]
    preempt = Fault(Kind.PREEMPT, 17, 0)
    v = verdict(drill, faults=[preempt], fault_times=[T0], events=events, scenario="preempt")
    (check,) = [c for c in v.checks if c.name == "steps redone within bound"]
    assert not check.ok
    assert check.detail == f"preempt redid 8 steps (bound 0); the preemption checkpoint was lost: {end}"


def test_a_differing_digest_gets_the_comparisons_verdict():
    rng = ItemDiff("torch_rng", 1, "cpu", "values differ")
    comparison = Comparison((StepDiff(10, ()), StepDiff(20, (rng,))))
    v = verdict(faithful_run(), digest="other", comparison=comparison)
    (check,) = [c for c in v.checks if c.name == "first state that differs from golden"]
    assert not check.ok and check.detail.startswith(
        "the global torch RNG of rank 1 differs from golden's at step 20"
    )
    assert "resume from step 10 (which equals golden's)" in check.detail
    same = verdict(faithful_run(), comparison=comparison)  # an equal digest: nothing to explain
    assert "first state that differs from golden" not in {c.name for c in same.checks}


def test_fault_not_injected_fails():
    faults = [Fault(Kind.KILL9, 17, 1)]
    v = verdict(GOLDEN, faults=faults, injected=[])
    assert {"faults injected"} <= failed(v)


def test_latest_violation_fails():
    v = verdict(faithful_run(), violations=["latest named step_00000020, which had no manifest.json"])
    assert failed(v) == {"latest never named an incomplete checkpoint"}


def test_incomplete_run_fails():
    v = verdict(faithful_run()[:-3])
    assert "run completed" in failed(v)


def test_preempt_bound_is_zero():
    assert steps_redone_bound(Kind.PREEMPT, EVERY, save_in_flight=True) == 0
    assert steps_redone_bound(Kind.KILL9, EVERY) == EVERY
    assert steps_redone_bound(Kind.DURING_SAVE, EVERY) == 2 * EVERY


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plan_is_reproducible_and_in_range(scenario):
    a = plan(scenario, seed=7, steps=80, save_every=10, ranks=4)
    assert a == plan(scenario, seed=7, steps=80, save_every=10, ranks=4)
    assert all(20 <= f.at_step < 80 and 0 <= f.rank < 4 for f in a)
    gaps = [b.at_step - x.at_step for x, b in itertools.pairwise(a)]
    assert all(g > 10 for g in gaps), gaps


def test_plan_shapes():
    assert [f.corruption for f in plan("corrupt-latest", seed=0, steps=80, save_every=10, ranks=2)] == list(
        DRILL
    )
    chaos = plan(CHAOS, seed=3, steps=80, save_every=10, ranks=2)
    assert 3 <= len(chaos) <= 4
    for seed in range(20):
        (f,) = plan("during-save", seed=seed, steps=80, save_every=10, ranks=2)
        assert f.at_step % 10 == 0 and f.at_step >= 20
    with pytest.raises(ValueError, match="unknown scenario"):
        plan("meteor", seed=0, steps=80, save_every=10, ranks=2)
    with pytest.raises(ValueError, match="too few"):
        plan(CHAOS, seed=0, steps=25, save_every=10, ranks=2)


def test_the_default_set_adapts_its_plans_to_the_steps():
    """40 steps, a save every 10: room for one fault between the second save and the last
    interval. Adapted, corrupt-latest does one kind of damage and chaos, which needs two faults,
    says so; asked for by name, both are refused. With room, nothing changes."""
    with pytest.raises(ValueError, match="too few for 3 corrupt-latest"):
        plan("corrupt-latest", seed=0, steps=40, save_every=10, ranks=2)
    (f,) = plan("corrupt-latest", seed=0, steps=40, save_every=10, ranks=2, adapt=True)
    assert f.corruption == DRILL[0]
    with pytest.raises(ValueError, match="too few for 2 chaos"):
        plan(CHAOS, seed=0, steps=40, save_every=10, ranks=2, adapt=True)
    assert len(plan(CHAOS, seed=0, steps=50, save_every=10, ranks=2, adapt=True)) == 2
    for seed in range(5):
        for scenario in ("corrupt-latest", CHAOS):
            kw = {"seed": seed, "steps": 80, "save_every": 10, "ranks": 2}
            assert plan(scenario, **kw, adapt=True) == plan(scenario, **kw)


# ---------------------------------------------------------------- hangs: culprit, SIGKILL, resume point

HUNG = Fault(Kind.HANG, 17, 1)
T0 = 1000.0


def logged(t: float, event: ev.Event, msg: str = "") -> Logged:
    """One line of the watchdog's log as the judge reads it (messages elided unless a check quotes one)."""
    return Logged(t, 0, msg, event)


def launch(n: int) -> ev.Launch:
    return ev.Launch(launch=n, launch_id=f"L{n}", pid=4200 + n, resumed_from=None)


def end_of(
    n: int, outcome: str, newest: int | None = None, exit_codes: dict[str, int] | None = None
) -> ev.LaunchEnd:
    return ev.LaunchEnd(
        launch=n,
        launch_id=f"L{n}",
        outcome=outcome,
        returncode=1,
        rank_exit_codes=exit_codes or {},
        last_step=None,
        newest_checkpoint=newest,
    )


def stuck(op: str = "all_gather", waiting=(0,), missing=(1,), other=()) -> dict:
    """A hang event's ``collective``, as watch/collectives.py's Stuck.to_dict() writes it."""
    return {
        "group": "0",
        "label": "group 0 (default_pg)",
        "seq": 57,
        "op": op,
        "waiting": list(waiting),
        "missing": [{"rank": r, "last": "all_reduce #56"} for r in missing],
        "other": [{"rank": r, "entered": f"{o} #57"} for r, o in other],
        "finished": [],
    }


def hang_events(
    *,
    culprit_rank: int = 1,
    funcs=("stuck_read", "maybe_hang", "loop"),
    sigkilled: int = 3,
    exit_codes=None,
    newest: int = 10,
    outcome: str = "hang",
    collective: dict | None = None,
    late_s: float = 0.04,
    stuck_s: float | None = 3.2,
    at=(),
) -> list[Logged]:
    """The watchdog's events for one hang, typed as the judge reads them."""
    frames = [{"func": f, "file": f"/w/{f}.py", "line": 1} for f in funcs]
    culprits = (
        [{"rank": culprit_rank, "pid": 4242, "where": "elsewhere", "frames": frames, "at": list(at)}]
        if funcs
        else []
    )
    hang = ev.Hang(
        ranks=[culprit_rank],
        detected=T0 + 5,
        culprits=culprits,
        waiting_ranks=[0],
        collective=stuck() if collective is None else collective,
        late_s=late_s,
        stuck_s=stuck_s,
    )
    return [
        logged(T0 - 5, launch(1)),
        logged(T0 + 5, hang),
        logged(T0 + 6, ev.StackDump(rank=0, pid=4241, path="/w/stacks_0", stacks="...")),
        logged(T0 + 16, ev.Kill(sigkilled=sigkilled), "hung launch killed"),
        logged(T0 + 16, end_of(1, outcome, newest, exit_codes or {})),
        logged(T0 + 17, launch(2)),
    ]


def hang_verdict(events, fault=HUNG, drill=None, timeout_s=4.0):
    run = ScenarioRun(
        fault.kind.value,
        Path(fault.kind.value),
        injected=[fault],
        save_in_flight=[fault.kind == Kind.HANG_DURING_SAVE],
        records=seen_after_fault(drill or faithful_run()),
        digest="d0",
        events=events,
        fault_times=[T0],
    )
    return judge(Case(fault.kind.value, [fault], run, GOLDEN, "d0", STEPS, EVERY, hang_timeout_s=timeout_s))


HANG_CHECKS = {
    "hang verdict names the culprit and its stack",
    "hung launch needed SIGKILL",
    "resumed from the last periodic checkpoint",
}
IN_TIME = "hang detected within the timeout + 0.5s"
COLLECTIVE = "hang verdict names the collective"


def test_a_real_hang_judged_right_passes():
    v = hang_verdict(hang_events())
    assert v.ok, v.failures()
    detail = {c.name: c.detail for c in v.checks}
    assert set(detail) >= HANG_CHECKS
    assert (
        "culprit rank 1 (pid 4242, elsewhere): stuck_read <- maybe_hang <- loop"
        in detail["hang verdict names the culprit and its stack"]
    )


@pytest.mark.parametrize(
    ("events", "failing", "says"),
    [
        (hang_events(culprit_rank=0), "hang verdict names the culprit and its stack", "named [0]"),
        (hang_events(funcs=()), "hang verdict names the culprit and its stack", "no culprit"),
        (
            hang_events(funcs=("wait", "loop")),
            "hang verdict names the culprit and its stack",
            "lacks stuck_read",
        ),
        (
            [e for e in hang_events() if not isinstance(e.event, ev.Hang)],
            {"hang verdict names the culprit and its stack", COLLECTIVE, IN_TIME},
            "no hang event",
        ),
        (hang_events(sigkilled=0), "hung launch needed SIGKILL", "SIGTERM ended"),
        (
            hang_events(exit_codes={"0": 75, "1": 75}),
            "resumed from the last periodic checkpoint",
            "exited 75",
        ),
        (
            hang_events(newest=20),
            "resumed from the last periodic checkpoint",
            "newest periodic checkpoint step 20",
        ),
        (hang_events(outcome="requeue"), "resumed from the last periodic checkpoint", "not a hang"),
        (hang_events(collective={}), COLLECTIVE, "names no collective"),
        (hang_events(collective=stuck(missing=(2,))), COLLECTIVE, "rank 1 is not named as missing"),
        (hang_events(collective=stuck(waiting=())), COLLECTIVE, "ranks [] wait in all_gather #57"),
        (hang_events(late_s=0.6), IN_TIME, "verdict 0.600s after the timeout ran out"),
        (hang_events(stuck_s=4.6), IN_TIME, "4.60s after the ranks entered the stuck collective"),
    ],
)
def test_a_hang_judged_wrong_fails_with_its_reason(events, failing, says):
    v = hang_verdict(events)
    failing = {failing} if isinstance(failing, str) else failing
    assert failed(v) == failing, v.failures()
    assert any(says in c.detail for c in v.checks if c.name in failing)


@pytest.mark.parametrize("picked", [True, False], ids=["memory pick", "no pick"])
def test_a_hang_resumed_from_the_memory_tier_passes_only_from_the_watchdogs_pick(picked: bool) -> None:
    """Under the memory tier a hang resumes from the snapshot of the last step every rank
    finished (16 here, after the disk's 10): the periodic check accepts it when the watchdog
    picked that snapshot; a resume from a step no checkpoint or pick holds still fails."""
    pick = ev.MemoryPick(step=16, launch=2, folder="/m", ranks=2, bytes=1, verify_s=0.1, disk_step=10)
    events = hang_events() + ([logged(T0 + 16.5, pick)] if picked else [])
    events.sort(key=lambda e: e.t)
    v = hang_verdict(events, drill=faithful_run(kill_at=17, resume_from=16))
    detail = {c.name: (c.ok, c.detail) for c in v.checks}
    ok, says = detail["resumed from the last periodic checkpoint"]
    assert ok == picked, says
    assert ("the memory snapshot of step 16" if picked else "newest periodic checkpoint step 10") in says


def test_a_culprit_without_its_stack_fails():
    events = hang_events()
    events[1].event.culprits[0]["frames"] = []
    v = hang_verdict(events)
    assert failed(v) == {"hang verdict names the culprit and its stack"}
    assert "named without its stack" in v.failures()[0]


def test_a_sigstop_needs_the_culprit_named_but_may_be_cured():
    """SIGCONT + SIGTERM cure a stopped rank: it checkpoints and exits 75, which is fine there; its
    stack is wherever it was stopped."""
    events = hang_events(funcs=("all_reduce", "loop"), sigkilled=0, exit_codes={"1": 75}, newest=17)
    stop = Fault(Kind.SIGSTOP, 17, 1)
    v = hang_verdict(events, fault=stop)
    assert v.ok, v.failures()
    assert {c.name for c in v.checks} & HANG_CHECKS == {"hang verdict names the culprit and its stack"}
    assert (
        "named [2]"
        in {c.name: c.detail for c in hang_verdict(hang_events(culprit_rank=2), fault=stop).checks}[
            "hang verdict names the culprit and its stack"
        ]
    )


def test_a_collective_mismatch_is_judged_on_the_op_the_culprit_entered():
    """hang-collective: the others wait in the all_reduce the culprit skipped; the culprit entered
    the barrier instead, with skip_collective in its stack."""
    fault = Fault(Kind.HANG_COLLECTIVE, 17, 1)
    mismatch = stuck("all_reduce", waiting=(0, 2, 3), missing=(), other=((1, "barrier"),))
    funcs = ("barrier", "wrapper", "skip_collective")
    v = hang_verdict(hang_events(funcs=funcs, collective=mismatch), fault=fault)
    assert v.ok, v.failures()
    detail = {c.name: c.detail for c in v.checks}
    assert (
        "ranks [0, 2, 3] wait in all_reduce #57 of group 0 (default_pg); rank 1 entered barrier #57"
        in detail[COLLECTIVE]
    )
    missing = hang_verdict(
        hang_events(funcs=funcs), fault=fault
    )  # named as missing, not as entering a barrier
    assert failed(missing) == {COLLECTIVE}, missing.failures()
    assert failed(hang_verdict(hang_events(collective=mismatch), fault=fault)) == {
        "hang verdict names the culprit and its stack"
    }


def test_a_loader_deadlock_needs_the_culprit_seen_in_the_dataloader():
    """hang-loader: the culprit's innermost frames are the standard library's (a queue's wait);
    the first frames outside it (``at``) must be the DataLoader's."""
    fault = Fault(Kind.HANG_LOADER, 17, 1)
    wait = ("select", "wait", "_poll")
    loader = [{"func": "_try_get_data", "file": "/v/torch/utils/data/dataloader.py", "line": 1291}]
    v = hang_verdict(hang_events(funcs=wait, at=loader), fault=fault)
    assert v.ok, v.failures()
    assert (
        "_try_get_data"
        in {c.name: c.detail for c in v.checks}["hang verdict names the culprit and its stack"]
    )
    elsewhere = hang_verdict(hang_events(funcs=wait), fault=fault)
    assert failed(elsewhere) == {"hang verdict names the culprit and its stack"}
    assert "lacks torch/utils/data/" in elsewhere.failures()[0]
    assert (
        steps_redone_bound(Kind.HANG_LOADER, EVERY) == 2 * EVERY
    )  # it hangs once the prefetched batches run out


def test_new_hang_kinds_are_planned_where_they_can_be_judged():
    """hang-collective needs a majority (3 ranks: the tiny config's batch splits over 4), hang-loader
    DataLoader workers; chaos draws neither, so every seed's chaos plan is what it was."""
    (f,) = plan("hang-collective", seed=0, steps=80, save_every=10, ranks=4)
    assert f.kind == Kind.HANG_COLLECTIVE and 0 <= f.rank < 4
    with pytest.raises(ValueError, match="needs --ranks 3 or more"):
        plan("hang-collective", seed=0, steps=80, save_every=10, ranks=2)
    with pytest.raises(ValueError, match="needs DataLoader workers"):
        plan("hang-loader", seed=0, steps=80, save_every=10, ranks=2, num_workers=0)
    for seed in range(30):
        kinds = {f.kind for f in plan(CHAOS, seed=seed, steps=80, save_every=10, ranks=4)}
        assert not kinds & {Kind.HANG_COLLECTIVE, Kind.HANG_LOADER}


def test_hang_during_save_may_redo_two_intervals():
    """The save in flight at the hang is lost by design: resuming one interval further back passes."""
    drill = curve("a", range(1, 21)) + curve("b", range(1, STEPS + 1))
    during = Fault(Kind.HANG_DURING_SAVE, 20, 1)
    v = hang_verdict(hang_events(newest=0), fault=during, drill=drill)
    assert "steps redone within bound" not in failed(v), v.failures()
    assert "resumed from the last periodic checkpoint" not in failed(v), v.failures()
    assert steps_redone_bound(Kind.HANG_DURING_SAVE, EVERY) == 2 * EVERY
    assert steps_redone_bound(Kind.HANG, EVERY) == EVERY


def test_no_hang_checks_for_scenarios_without_hangs():
    assert not {c.name for c in verdict(faithful_run()).checks} & HANG_CHECKS


def test_hang_during_save_strikes_at_a_save_step():
    for seed in range(20):
        (f,) = plan("hang-during-save", seed=seed, steps=80, save_every=10, ranks=4)
        assert f.at_step % 10 == 0 and 20 <= f.at_step < 70


# ---------------------------------------------------------------- storage faults

STORAGE_KINDS = {Kind.IO_ERROR, Kind.DISK_FULL, Kind.SLOW_STORAGE}


def test_storage_scenarios_plan_one_fault_and_chaos_never_draws_them():
    for seed in range(20):
        assert not {f.kind for f in plan(CHAOS, seed=seed, steps=80, save_every=10, ranks=4)} & STORAGE_KINDS
        for kind in STORAGE_KINDS:
            (f,) = plan(kind.value, seed=seed, steps=80, save_every=10, ranks=4)
            assert f.kind == kind and 0 <= f.rank < 4
            # A full disk leaves room for the save it may fill in, two failed saves and one that works again.
            room = DISK_FULL_INTERVALS * 10 if kind == Kind.DISK_FULL else 10
            assert 20 < f.at_step <= 80 - room, (kind, f)
    with pytest.raises(ValueError, match="too few"):
        plan("disk-full", seed=0, steps=60, save_every=10, ranks=2)


def test_the_disk_fills_at_a_random_moment_of_a_save():
    """disk-full lets a drawn number of writing operations into tmp dirs through first: the disk
    fills somewhere inside a save (issue 44), at a different point for each seed."""
    fills = {
        plan("disk-full", seed=seed, steps=80, save_every=10, ranks=2)[0].fill_after for seed in range(20)
    }
    assert len(fills) > 10 and all(0 <= n < DISK_FULL_FILL_WITHIN for n in fills)
    assert {
        f.fill_after
        for s in SCENARIOS
        if s != "disk-full"
        for f in plan(s, seed=3, steps=80, save_every=10, ranks=4)
    } == {0}


def storage_verdict(fault: Fault, events: list[Logged], facts: StorageFacts, drill=None) -> Verdict:
    drill = drill if drill is not None else faithful_run()
    return verdict(
        seen_after_fault(drill),
        faults=[fault],
        scenario=fault.kind.value,
        events=events,
        fault_times=[T0],
        storage=facts,
    )


IO_ERROR = Fault(Kind.IO_ERROR, 17, 1)


def io_events(newest: int = 10) -> list[Logged]:
    return [
        logged(T0 - 20, launch(1)),
        logged(T0 + 2, end_of(1, "crash", newest)),
        logged(T0 + 3, ev.IoRetry(), "step_00000010/manifest.json: EIO"),
        logged(T0 + 5, ev.Pick(checkpoint="step_00000010", verify="quick")),
        logged(T0 + 5, launch(2)),
    ]


def test_an_eio_burst_met_and_ridden_out_passes():
    v = storage_verdict(IO_ERROR, io_events(), StorageFacts(rule_hits=3))
    assert v.ok, v.failures()
    detail = {c.name: c.detail for c in v.checks}
    assert (
        "3 checkpoint read(s) failed with EIO; the watchdog retried 1 time(s)"
        in detail["EIO met by the resume"]
    )
    assert (
        "resumed from step 10, newest committed when the launch ended: step 10"
        in detail["resumed from the newest committed checkpoint"]
    )


@pytest.mark.parametrize(
    ("events", "facts", "failing", "says"),
    [
        (io_events(), StorageFacts(rule_hits=0), "EIO met by the resume", "never fired"),
        (
            io_events(newest=20),
            StorageFacts(rule_hits=3),
            "resumed from the newest committed checkpoint",
            "step 20",
        ),
        (
            [
                *io_events(),
                logged(
                    T0 + 4,
                    ev.Quarantine(checkpoint="step_00000010", why="step_00000010: manifest.json unreadable"),
                ),
            ],
            StorageFacts(rule_hits=3),
            "nothing quarantined",
            "step_00000010: manifest.json unreadable",
        ),
        (
            io_events(),
            StorageFacts(rule_hits=3, quarantined=("step_00000010-20261130T120000Z",)),
            "nothing quarantined",
            "step_00000010-20261130T120000Z",
        ),
    ],
)
def test_an_eio_burst_judged_wrong_fails_with_its_reason(events, facts, failing, says):
    v = storage_verdict(IO_ERROR, events, facts)
    assert failed(v) == {failing}, v.failures()
    assert says in {c.name: c.detail for c in v.checks}[failing]


DISK_FULL = Fault(Kind.DISK_FULL, 12, 0)
FILLED = StorageFacts(rule_hits=10, committed_before=(5, 10), committed_after=(5, 10))


def disk_events(*, recovered: bool = True, most: int = 2) -> list[Logged]:
    evs = [logged(T0 - 20, launch(1))]
    evs += [
        logged(
            T0 + n,
            ev.SaveFailed(rank=0, ranks=[0], step=10 * n, save_failures=n, last_error="rank 0: ENOSPC"),
        )
        for n in range(1, most + 1)
    ]
    if recovered:
        evs.append(
            logged(T0 + 5, ev.SaveRecovered(rank=0, ranks=[0], step=40, save_failures=0, last_error=""))
        )
    return [*evs, logged(T0 + 9, end_of(1, "done", 40))]


def test_a_full_disk_ridden_out_in_one_launch_passes():
    v = storage_verdict(DISK_FULL, disk_events(), FILLED, drill=GOLDEN)
    assert v.ok, v.failures()
    names = {c.name for c in v.checks}
    assert "resumed after each fault" not in names  # nothing to resume: the job rode it out
    assert {"saves failed, then recovered", "one launch, no relaunch", "no tmp dir left"} <= names
    assert "save_recovered at step 40" in {c.name: c.detail for c in v.checks}["saves failed, then recovered"]


@pytest.mark.parametrize(
    ("events", "facts", "drill", "failing"),
    [
        (disk_events(recovered=False), FILLED, GOLDEN, {"saves failed, then recovered"}),
        (disk_events(most=1), FILLED, GOLDEN, {"saves failed, then recovered"}),
        (
            [*disk_events(), logged(T0 + 6, launch(2))],
            FILLED,
            faithful_run(),
            {"one launch, no relaunch"},
        ),
        (disk_events(), replace(FILLED, tmp_left=("step_00000020.tmp.77.h",)), GOLDEN, {"no tmp dir left"}),
        (disk_events(), replace(FILLED, committed_after=(5,)), GOLDEN, {"no committed checkpoint lost"}),
    ],
)
def test_a_full_disk_judged_wrong_fails_with_its_reason(events, facts, drill, failing):
    assert failed(storage_verdict(DISK_FULL, events, facts, drill=drill)) == failing


SLOW = Fault(Kind.SLOW_STORAGE, 17, 1)
THROTTLED = StorageFacts(rule_hits=400, verify_s=6.0, load_s=9.0, beat_gap_s=1.5, timeout_s=4.0)


def slow_events(*, hang: bool = False, resumed_outcome: str = "done") -> list[Logged]:
    evs = [logged(T0 - 20, launch(1)), logged(T0 + 2, end_of(1, "crash", 10)), logged(T0 + 9, launch(2))]
    if hang:
        hung = ev.Hang(ranks=[0], detected=T0 + 20)
        evs.append(logged(T0 + 20, hung, "rank 0 made no progress for 4.2s in phase verify"))
    return [*evs, logged(T0 + 60, end_of(2, resumed_outcome, 10))]


def test_slow_storage_that_progresses_passes():
    v = storage_verdict(SLOW, slow_events(), THROTTLED)
    assert v.ok, v.failures()
    assert (
        "verify 6.0s + load 9.0s = 15.0s: 3.8x the --verify-timeout/--load-timeout 4s"
        in {c.name: c.detail for c in v.checks}["storage slower than the phase timeouts"]
    )


@pytest.mark.parametrize(
    ("events", "facts", "failing"),
    [
        (slow_events(hang=True), THROTTLED, {"no hang verdict on slow storage"}),
        (slow_events(resumed_outcome="hang"), THROTTLED, {"resumed launch finished"}),
        (slow_events(), replace(THROTTLED, load_s=1.0), {"storage slower than the phase timeouts"}),
        (slow_events(), replace(THROTTLED, verify_s=None), {"storage slower than the phase timeouts"}),
    ],
)
def test_slow_storage_judged_wrong_fails_with_its_reason(events, facts, failing):
    assert failed(storage_verdict(SLOW, events, facts)) == failing


def test_a_skipped_scenario_is_no_pass_and_no_failure():
    ran = storage_verdict(IO_ERROR, io_events(), StorageFacts(rule_hits=3))
    skipped = Verdict("disk-full", (), skipped="no /dev/fuse on this machine")
    assert skipped.ok and skipped.result == "SKIPPED" and ran.result == "PASS"
    assert summary([ran, skipped]) == ("PASS", "1 of 1 scenarios (skipped: disk-full)")
    assert "disk-full  SKIPPED  -" in verdict_table([ran, skipped]) and "no /dev/fuse" in verdict_table(
        [skipped]
    )


def test_storage_scenarios_run_when_asked_for():
    assert (
        not set(chosen(None, False)) & {k.value for k in STORAGE_KINDS} and chosen(None, False)[-1] == CHAOS
    )
    assert chosen(None, True)[-4:] == ["io-error", "disk-full", "slow-storage", "hostile"]
    assert chosen(["storage"], False) == ["io-error", "disk-full", "slow-storage", "hostile"]
    assert chosen(["kill9", "disk-full"], True) == [
        "kill9",
        "disk-full",
        "io-error",
        "slow-storage",
        "hostile",
    ]
    assert driver_for([IO_ERROR]).kinds == {Kind.IO_ERROR} and driver_for([HUNG]) is None


def test_the_phase_clock_times_each_phase_per_rank_and_the_longest_silence_in_verify_or_load(tmp_path):
    """The beats a poll sees, written as the trainer would: the old launch is ignored; the time in
    a phase runs from a rank's first beat in it to its first beat in the next; building the model
    (startup, between verify and load) is no gap of the I/O phases, leaving load for train is."""
    clock = PhaseClock(tmp_path, "old")

    def beat(rank: int, phase: Phase, t: float, launch: str = "new") -> None:
        write_heartbeat(tmp_path, Heartbeat(rank, rank, "h", 100 + rank, 20, phase, t, launch_id=launch))
        clock.poll()

    beat(0, Phase.TRAIN, 1.0, launch="old")
    for rank, phase, t in [
        (0, Phase.VERIFY, 10.0),
        (1, Phase.VERIFY, 10.5),
        (0, Phase.VERIFY, 11.5),  # 1.5 s since its last beat
        (0, Phase.STARTUP, 13.0),  # verify done: 3 s
        (1, Phase.STARTUP, 14.0),  # verify done: 3.5 s
        (0, Phase.LOAD, 20.0),  # 7 s building the model: not an I/O gap
        (1, Phase.LOAD, 20.0),
        (0, Phase.TRAIN, 25.0),  # load: 5 s, all in one silence
        (1, Phase.TRAIN, 22.0),
    ]:
        beat(rank, phase, t)
    assert clock.time_in(Phase.VERIFY) == 3.5 and clock.time_in(Phase.LOAD) == 5.0
    assert clock.gap == 5.0 and clock.time_in(Phase.DIGEST) is None


def test_what_the_run_dir_holds_at_the_end_goes_to_the_storage_checks(tmp_path):
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    store.quarantine_step(tmp_path, 20, "test: damaged")
    tmp = store.begin(tmp_path, 30)
    facts = at_end(StorageFacts(rule_hits=3), tmp_path)
    assert facts.rule_hits == 3 and facts.tmp_left == (tmp.name,)
    (q,) = facts.quarantined
    assert q.startswith("step_00000020-")


def test_the_report_says_why_there_is_no_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    line = report.plot(tmp_path / "loss.png", [], [], [])
    assert "matplotlib is not installed" in line and not (tmp_path / "loss.png").exists()
    report.write_report(
        tmp_path / "report.md", settings="s", golden_digest="0" * 64, runs=[], verdicts=[], plot_line=line
    )
    assert line in (tmp_path / "report.md").read_text()


def test_the_json_report_carries_every_check_fault_and_resume_and_redacts_urls(tmp_path):
    """drill --json's document: a failed scenario with its failing check, a skipped one with its
    reason, what was injected, the resumes; a credential in a note is redacted."""
    drill = faithful_run(resume_from=0)
    bad = verdict(drill)  # a resume that restarted from step 0: more redone than the bound
    skipped = Verdict("disk-full", (), skipped="no /dev/fuse on this machine")
    run = ScenarioRun("kill9", tmp_path, injected=[Fault(Kind.KILL9, 17, 1)], records=drill, digest="d1")
    run.notes.append("uploaded to s3://AKIAEXAMPLE:secret@bucket/x")
    files = {"report": "r.md", "plot": None, "log": "d.log"}
    doc = json.loads(json.dumps(report.json_report({"seed": 0}, "d0", [run], [bad, skipped], files)))
    assert (doc["schema"], doc["ok"], doc["verdict"]) == (report.DRILL_SCHEMA, False, "FAIL")
    assert doc["summary"] == "0 of 1 scenarios (skipped: disk-full)" and doc["plot"] is None
    first, second = doc["scenarios"]
    assert first["result"] == "FAIL" and first["digest"] == "d1"
    assert {c["name"] for c in first["checks"] if not c["ok"]} == failed(bad)
    assert first["injected"] == [{"kind": "kill9", "at_step": 17, "rank": 1, "corruption": None}]
    assert first["resumes"] == [
        {"launch": "b", "ckpt_step": 0, "reached": 17, "first_seen": 0.0, "redone": 17}
    ]
    assert "secret" not in json.dumps(doc)
    assert (second["result"], second["skipped"], second["checks"]) == (
        "SKIPPED",
        "no /dev/fuse on this machine",
        [],
    )


def memory_pick(step: int, disk_step: int | None) -> ev.MemoryPick:
    return ev.MemoryPick(
        step=step, launch=2, folder="/dev/shm/m", ranks=2, bytes=1, verify_s=0.0, disk_step=disk_step
    )


def test_memory_kill_is_planned_on_a_step_no_save_holds_and_may_redo_none():
    faults = [plan("memory", seed=s, steps=80, save_every=EVERY, ranks=2)[0] for s in range(30)]
    assert all(f.kind == Kind.MEMORY and f.at_step % EVERY for f in faults)
    assert steps_redone_bound(Kind.MEMORY, EVERY) == 0  # a snapshot every step: the reference trainer
    assert steps_redone_bound(Kind.MEMORY, EVERY, memory_every=0) == EVERY  # a user's own interval


def test_a_memory_kill_passes_only_when_resumed_from_the_memory_pick_newer_than_the_disk():
    """Killed after step 17 (the disk has 10): a resume from the memory snapshot of step 17 passes;
    the same resume with no pick logged, or a pick no newer than the disk's, fails the check."""
    fault = Fault(Kind.MEMORY, 17, 1)
    drill = seen_after_fault(faithful_run(kill_at=17, resume_from=17))

    def judged(*picked: ev.Event):
        return verdict(
            drill,
            faults=[fault],
            scenario="memory",
            fault_times=[T0],
            events=[logged(T0 + 1, e) for e in picked],
        )

    v = judged(memory_pick(17, 10))
    assert v.ok, v.failures()
    assert "memory snapshot picked: step 17, on disk: step 10" in next(
        c.detail for c in v.checks if c.name == "resumed from the memory tier"
    )
    assert failed(judged()) == {"resumed from the memory tier"}
    assert failed(judged(ev.MemoryFallback(reason="no snapshot in memory"))) == {
        "resumed from the memory tier"
    }
    assert failed(judged(memory_pick(17, 17))) == {"resumed from the memory tier"}

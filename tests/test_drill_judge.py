"""The drill's plan and judge are pure: tested here on synthetic runs, without processes."""

from __future__ import annotations

import itertools
import math

import pytest

from supervisor.drill.judge import StepRecord, find_resumes, judge
from supervisor.drill.plan import CHAOS, CORRUPTIONS, SCENARIOS, Fault, Kind, plan, steps_redone_bound

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


def verdict(drill, *, faults=None, injected=None, in_flight=None, digest="d0", violations=()):
    faults = faults if faults is not None else [Fault(Kind.KILL9, 17, 1)]
    injected = injected if injected is not None else faults
    return judge(
        "kill9",
        faults=faults,
        injected=injected,
        save_in_flight=in_flight if in_flight is not None else [False] * len(injected),
        golden=GOLDEN,
        drill=drill,
        steps=STEPS,
        save_every=EVERY,
        golden_digest="d0",
        drill_digest=digest,
        latest_violations=list(violations),
    )


def failed(v) -> set[str]:
    return {c.name for c in v.checks if not c.ok}


def test_faithful_resume_passes():
    v = verdict(faithful_run())
    assert v.ok, v.failures()
    assert [(r.ckpt_step, r.reached, r.redone) for r in v.resumes] == [(10, 17, 7)]


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
        CORRUPTIONS
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


# ---------------------------------------------------------------- hangs: culprit, SIGKILL, resume point

HUNG = Fault(Kind.HANG, 17, 1)
T0 = 1000.0


def hang_events(
    *,
    culprit_rank: int = 1,
    funcs=("stuck_read", "maybe_hang", "loop"),
    sigkilled: int = 3,
    exit_codes=None,
    newest: int = 10,
    outcome: str = "hang",
) -> list[dict]:
    """The watchdog's events for one hang, as it writes them (fields only; messages elided)."""
    frames = [{"func": f, "file": f"/w/{f}.py", "line": 1} for f in funcs]
    culprits = [{"rank": culprit_rank, "pid": 4242, "where": "elsewhere", "frames": frames}] if funcs else []
    return [
        {"t": T0 - 5, "event": "launch", "launch": 1},
        {"t": T0 + 5, "event": "hang", "culprits": culprits, "waiting_ranks": [0]},
        {"t": T0 + 6, "event": "stack_dump", "rank": 0},
        {"t": T0 + 16, "event": "kill", "msg": "hung launch killed", "sigkilled": sigkilled},
        {
            "t": T0 + 16,
            "event": "launch_end",
            "outcome": outcome,
            "rank_exit_codes": exit_codes or {},
            "newest_checkpoint": newest,
        },
        {"t": T0 + 17, "event": "launch", "launch": 2},
    ]


def hang_verdict(events, fault=HUNG, drill=None):
    drill = drill or faithful_run()
    drill = [StepRecord(r.step, r.loss, r.lr, r.launch, T0 + (30 if r.launch == "b" else -1)) for r in drill]
    return judge(
        fault.kind.value,
        faults=[fault],
        injected=[fault],
        save_in_flight=[fault.kind == Kind.HANG_DURING_SAVE],
        golden=GOLDEN,
        drill=drill,
        steps=STEPS,
        save_every=EVERY,
        golden_digest="d0",
        drill_digest="d0",
        latest_violations=[],
        events=events,
        fault_times=[T0],
    )


HANG_CHECKS = {
    "hang verdict names the culprit and its stack",
    "hung launch needed SIGKILL",
    "resumed from the last periodic checkpoint",
}


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
            [e for e in hang_events() if e["event"] != "hang"],
            "hang verdict names the culprit and its stack",
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
    ],
)
def test_a_hang_judged_wrong_fails_with_its_reason(events, failing, says):
    v = hang_verdict(events)
    assert failed(v) == {failing}, v.failures()
    assert says in {c.name: c.detail for c in v.checks}[failing]


def test_a_culprit_without_its_stack_fails():
    events = hang_events()
    events[1]["culprits"][0]["frames"] = []
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

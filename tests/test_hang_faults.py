"""The hang sweep's plan and its counting (tests/hang_faults.py; ``make hang-sweep`` runs it, 20
trials per kind). Each kind runs end to end once in tests/test_drill_e2e.py; the sweep repeats
them, so what is tested here is that its faults are the trials it says and that a failed check
is counted as one and reported with its trial."""

from __future__ import annotations

from hang_faults import FIRST, GAP, KINDS, RANKS, SAVE_EVERY, KindResult, faults, steps_for

from supervisor.drill.judge import COLLECTIVE, NAMED, Check, Verdict
from supervisor.drill.plan import IN_SAVE, Kind


def test_the_plan_puts_one_fault_per_trial_gap_steps_apart_on_random_ranks_before_the_end() -> None:
    for kind in KINDS:
        planned = faults(kind, 20, seed=42)
        steps = [f.at_step for f in planned]
        assert len(planned) == 20 and {f.kind for f in planned} == {kind}
        assert steps == [FIRST + GAP * i for i in range(20)], steps
        assert steps[-1] + GAP <= steps_for(20), "the last fault has a gap to resume in"
        assert {f.rank for f in planned} <= set(range(RANKS)) and len({f.rank for f in planned}) > 1
        if kind in IN_SAVE:
            assert all(s % SAVE_EVERY == 0 for s in steps), "a hang in a save strikes at a save step"
        assert faults(kind, 20, seed=42) == planned != faults(kind, 20, seed=43)


def test_a_failed_check_counts_against_its_kind_and_is_reported_with_its_trial() -> None:
    planned = faults(Kind.HANG_COLLECTIVE, 3, seed=1)
    ok = {NAMED: (True, "culprit named"), COLLECTIVE: (True, "collective named")}
    bad = {NAMED: (True, "culprit named"), COLLECTIVE: (False, "rank 2 is not named as missing")}
    verdict = Verdict("hang-collective", (Check("digest equal", True, "same"),))
    r = KindResult(Kind.HANG_COLLECTIVE, 3, verdict, [(planned[0], ok), (planned[1], bad)])
    assert r.count(NAMED) == (2, 2) and r.count(COLLECTIVE) == (1, 2)
    assert r.failures() == [
        "hang-collective: hang verdict names the collective: rank 2 is not named as missing",
        "hang-collective: 1 of 3 faults not judged (not injected)",
    ]

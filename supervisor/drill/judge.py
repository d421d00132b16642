"""The verdict: is the faulted run the same run as the golden one? Pure functions over records.

Every check returns a reason a person can act on; a scenario passes only when every check holds.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.drill.plan import Fault, steps_redone_bound


@dataclass(frozen=True)
class StepRecord:
    """One line of metrics.jsonl as the drill saw it (``seen`` = when the drill first read it)."""

    step: int
    loss: float
    lr: float
    launch: str
    seen: float = 0.0


@dataclass(frozen=True)
class Resume:
    """A launch that continued the run: it started after ``ckpt_step``, having reached ``reached``."""

    launch: str
    ckpt_step: int
    reached: int
    first_seen: float

    @property
    def redone(self) -> int:
        return self.reached - self.ckpt_step


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Verdict:
    scenario: str
    checks: tuple[Check, ...]
    resumes: tuple[Resume, ...] = ()

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]


def find_resumes(records: Sequence[StepRecord]) -> list[Resume]:
    """Each launch after the first, with the checkpoint step it resumed from and how far the run
    had got before it (records are in file order; a launch's steps are consecutive)."""
    resumes: list[Resume] = []
    reached = 0
    current = None
    for r in records:
        if current is not None and r.launch != current:
            resumes.append(Resume(r.launch, r.step - 1, reached, r.seen))
        current = r.launch
        reached = max(reached, r.step)
    return resumes


def typical_step_change(golden: Sequence[StepRecord]) -> tuple[float, float]:
    """Median and largest |loss(s+1) - loss(s)| of the golden run: normal step-to-step variation."""
    deltas = [abs(b.loss - a.loss) for a, b in itertools.pairwise(golden)]
    return (statistics.median(deltas), max(deltas)) if deltas else (0.0, 0.0)


def judge(
    scenario: str,
    *,
    faults: Sequence[Fault],
    injected: Sequence[Fault],
    save_in_flight: Sequence[bool],
    golden: Sequence[StepRecord],
    drill: Sequence[StepRecord],
    steps: int,
    save_every: int,
    golden_digest: str,
    drill_digest: str | None,
    latest_violations: Sequence[str],
    loss_tol: float = 0.0,
) -> Verdict:
    """Judge one scenario. ``loss_tol`` is 0 on CPU: the resumed run must match golden exactly."""
    checks: list[Check] = []
    gold = {r.step: r for r in golden}
    resumes = find_resumes(drill)

    missing = [f.describe() for f in faults if f not in injected]
    checks.append(
        Check(
            "faults injected",
            not missing,
            f"{len(injected)} of {len(faults)}"
            + (f"; not injected: {'; '.join(missing)}" if missing else ""),
        )
    )
    checks.append(
        Check(
            "resumed after each fault",
            len(resumes) >= len(injected),
            f"{len(resumes)} resume(s) for {len(injected)} fault(s)",
        )
    )

    over = []
    for res, fault, in_flight in zip(resumes, injected, save_in_flight, strict=False):
        bound = steps_redone_bound(fault.kind, save_every, in_flight)
        if res.redone > bound:
            over.append(f"{fault.kind.value} redid {res.redone} steps (bound {bound})")
    redone = ", ".join(str(r.redone) for r in resumes) or "none"
    checks.append(Check("steps redone within bound", not over, "; ".join(over) or f"redone: {redone}"))

    lr_bad = [r.step for r in drill if r.step in gold and r.lr != gold[r.step].lr]
    checks.append(
        Check(
            "LR continuous",
            not lr_bad,
            f"LR differs from the schedule at step {lr_bad[0]}: {_lr_at(drill, lr_bad[0])} vs "
            f"{gold[lr_bad[0]].lr}"
            if lr_bad
            else "LR equals golden at every step, resumed steps included",
        )
    )

    median_d, max_d = typical_step_change(golden)
    by_launch_step = {(r.launch, r.step): r for r in drill}
    jumps = []
    for res in resumes:
        after = by_launch_step.get((res.launch, res.ckpt_step + 1))
        before = gold.get(res.ckpt_step)
        if after and before:
            jumps.append(abs(after.loss - before.loss))
    worst_jump = max(jumps, default=0.0)
    deviations = [(abs(r.loss - gold[r.step].loss), r.step) for r in drill if r.step in gold]
    worst_dev, worst_step = max(deviations, default=(0.0, 0))
    checks.append(
        Check(
            "loss continuous",
            worst_dev <= loss_tol and worst_jump <= max_d,
            f"largest jump at a resume {worst_jump:.4g} (golden step-to-step: median {median_d:.4g}, "
            f"max {max_d:.4g}); largest deviation from golden {worst_dev:.3g}"
            + (f" at step {worst_step}" if worst_dev > loss_tol else ""),
        )
    )

    checks.append(
        Check(
            "latest never named an incomplete checkpoint",
            not latest_violations,
            latest_violations[0] if latest_violations else "watched during the whole run",
        )
    )

    last = max((r.step for r in drill), default=0)
    checks.append(Check("run completed", last == steps, f"last step {last} of {steps}"))
    checks.append(
        Check(
            "final digest equals golden",
            drill_digest == golden_digest,
            f"{(drill_digest or 'missing')[:16]} vs golden {golden_digest[:16]}",
        )
    )
    return Verdict(scenario, tuple(checks), tuple(resumes))


def _lr_at(records: Sequence[StepRecord], step: int) -> float:
    return next(r.lr for r in records if r.step == step)

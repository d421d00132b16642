"""Hangs as they really happen, diagnosed to the rank and the collective (issue 42): the sweep, shared
by ``make hang-sweep`` (20 trials per kind, the table printed; docs/measured.md keeps the last) and
tests/test_hang_faults.py (its plan and its counting; the drill's own tests run each kind once):

    .venv/bin/python tests/hang_faults.py --trials 20 [--kinds hang-collective,hang-loader] [--workdir DIR]

Each kind is one run of the reference trainer (4 ranks, FSDP, 2 DataLoader workers per rank) under
``supervisor watch`` (``--standby``: a relaunch takes seconds, not a cold start), driven by the
drill (supervisor/drill/runner.py) with ``--trials`` faults of that kind, one every ``GAP`` steps,
each on a rank drawn at random; every fault fires once, the watchdog finds the hang, kills the
launch, and the next launch resumes and runs into the next fault. Each fault is one trial, judged
by the drill's own checks (supervisor/drill/judge.py ``hang_trials``): the culprit named with its
stack, the collective named (the others wait in it; the culprit never entered it, or entered
another one), the verdict within the train timeout + 0.5 s (of the first rank's timeout running
out, and of the ranks' entry into the stuck collective), SIGKILL needed, the resume from the last
periodic checkpoint. The run as a whole must end digest-equal to an uninterrupted run (one for all
kinds), its loss and learning rate those of the uninterrupted run at every step.

Kinds: hang (a read that never returns), hang-during-save (the same, an async save in flight),
hang-collective (the culprit skips the all_reduce the others enter and enters a barrier), hang-loader
(a DataLoader worker of the culprit blocks forever on a lock).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script too

from sweep_cli import run_and_report  # noqa: E402

from supervisor.drill.judge import (  # noqa: E402
    COLLECTIVE,
    IN_TIME,
    KILLED,
    NAMED,
    PERIODIC,
    Case,
    Verdict,
    fault_windows,
    hang_trials,
    judge,
)
from supervisor.drill.plan import Fault, Kind  # noqa: E402
from supervisor.drill.runner import DrillConfig, ScenarioRun, run_golden, run_scenario  # noqa: E402
from supervisor.format import eventtypes as ev  # noqa: E402

RANKS = 4  # the tiny config's batch of 8 splits over 4; hang-collective needs 3 for a majority
SAVE_EVERY = 2
GAP = 8  # steps between two faults: a loader hang strikes a few steps late, and each needs a resume
FIRST = 3 * SAVE_EVERY  # after two saves; a save step (hang-during-save strikes inside a save)
TIMEOUT_S = 4.0
KINDS = (Kind.HANG_COLLECTIVE, Kind.HANG_LOADER, Kind.HANG, Kind.HANG_DURING_SAVE)
WATCH = (
    "--standby", "--kill-grace", "1",
    "--max-restarts", "1000", "--max-restarts-per-window", "1000", "--no-progress", "0",
)  # fmt: skip
CHECKS = (NAMED, COLLECTIVE, IN_TIME, KILLED, PERIODIC)


def steps_for(trials: int) -> int:
    return FIRST + GAP * trials + GAP


def faults(kind: Kind, trials: int, seed: int) -> list[Fault]:
    rng = random.Random(f"{seed}:{kind.value}")
    return [Fault(kind, FIRST + GAP * i, rng.randrange(RANKS)) for i in range(trials)]


def config(base: Path, trials: int, seed: int) -> DrillConfig:
    return DrillConfig(
        seed=seed,
        ranks=RANKS,
        steps=steps_for(trials),
        save_every=SAVE_EVERY,
        hang_timeout_s=TIMEOUT_S,
        workdir=base,
        num_workers=2,
        watch_extra=WATCH,
    )


@dataclass
class KindResult:
    kind: Kind
    planned: int
    verdict: Verdict
    trials: list[tuple[Fault, dict[str, tuple[bool, str]]]]
    late_s: list[float] = field(default_factory=list)  # each verdict after the first timeout ran out
    stuck_s: list[float] = field(default_factory=list)  # each verdict after the ranks got stuck
    verdicts: list[str] = field(default_factory=list)  # each hang event's message
    took_s: float = 0.0

    def count(self, check: str) -> tuple[int, int]:
        judged = [got[check][0] for _, got in self.trials if check in got]
        return sum(judged), len(judged)

    def failures(self) -> list[str]:
        bad = [
            f"{self.kind.value}: {n}: {d}" for _, got in self.trials for n, (ok, d) in got.items() if not ok
        ]
        missing = self.planned - len(self.trials)
        if missing:
            bad.append(f"{self.kind.value}: {missing} of {self.planned} faults not judged (not injected)")
        whole = [
            f"{self.kind.value}: {line}" for line in self.verdict.failures() if not line.startswith(CHECKS)
        ]
        return bad + whole


def run_kind(cfg: DrillConfig, kind: Kind, trials: int, golden: tuple, log: Path) -> KindResult:
    t0 = time.monotonic()
    planned = faults(kind, trials, cfg.seed)

    def progress(msg: str, run: ScenarioRun) -> None:
        if msg:
            print(
                f"[hang-sweep] {kind.value}: {msg} (faults {len(run.injected)}/{trials})",
                file=sys.stderr,
                flush=True,
            )

    run = run_scenario(cfg, kind.value, planned, log, progress)
    records, digest = golden
    case = Case(
        kind.value, planned, run, records, digest, cfg.steps, cfg.save_every, hang_timeout_s=TIMEOUT_S
    )
    verdict = judge(case)
    windows = fault_windows(run.events, run.fault_times, case.resumes)
    trials_judged = hang_trials(run.injected, windows, case.resumes, cfg.save_every, TIMEOUT_S)
    hangs = [ev.first(w, ev.Hang) for w in windows]
    return KindResult(
        kind,
        len(planned),
        verdict,
        trials_judged,
        [h.event.late_s for h in hangs if h],
        [h.event.stuck_s for h in hangs if h and h.event.stuck_s is not None],
        [h.msg for h in hangs if h],
        time.monotonic() - t0,
    )


@dataclass
class Sweep:
    results: list[KindResult]
    took_s: float

    def failures(self) -> list[str]:
        return [f for r in self.results for f in r.failures()]

    def report(self) -> str:
        lines = [
            f"hang sweep: {RANKS} ranks, train timeout {TIMEOUT_S:g}s, {self.took_s / 60:.1f} min",
            "",
            "| kind | trials | " + " | ".join(CHECKS) + " | late_s median/max | stuck_s median/max | run |",
            "|---|---|" + "---|" * len(CHECKS) + "---|---|---|",
        ]
        for r in self.results:
            cells = []
            for c in CHECKS:
                ok, n = r.count(c)
                cells.append(f"{ok}/{n}" if n else "-")
            lines.append(
                f"| {r.kind.value} | {len(r.trials)}/{r.planned} | "
                + " | ".join(cells)
                + f" | {_spread(r.late_s)} | {_spread(r.stuck_s)} | {r.verdict.result} ({r.took_s / 60:.1f} min) |"
            )
        lines.append("")
        for r in self.results:
            if r.verdicts:
                lines.append(f"{r.kind.value}, first verdict: {r.verdicts[0]}")
        return "\n".join(lines)


def _spread(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs):.3f}/{max(xs):.3f}" if xs else "-"


def sweep(base: Path, trials: int, kinds: Sequence[Kind] = KINDS, seed: int = 42) -> Sweep:
    t0 = time.monotonic()
    base.mkdir(parents=True, exist_ok=True)
    cfg = config(base, trials, seed)
    log = base / "sweep.log"
    golden = run_golden(cfg, log)
    results = [run_kind(cfg, k, trials, golden, log) for k in kinds]
    return Sweep(results, time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per kind")
    ap.add_argument("--kinds", default=",".join(k.value for k in KINDS), help="comma-separated")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed")
    args = ap.parse_args()
    kinds = [Kind(k) for k in args.kinds.split(",") if k]
    return run_and_report(
        args.workdir, "hang-faults-", lambda work: sweep(work, args.trials, kinds, args.seed)
    )


if __name__ == "__main__":
    sys.exit(main())

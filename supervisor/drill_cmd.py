"""``python -m supervisor drill``: golden run, faulted runs under the watchdog, verdict, report.

Exit 0 only when every check of every scenario holds; 1 when any fails; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from supervisor.drill import plan as planning
from supervisor.drill.judge import Verdict, judge
from supervisor.drill.report import plot, verdict_table, write_report
from supervisor.drill.runner import DrillConfig, ScenarioRun, run_golden, run_scenario
from supervisor.errors import UserError
from supervisor.exitcodes import Exit
from supervisor.fmt import human_duration

# Every scenario but sigstop (a stop the watchdog's own SIGCONT cures; `hang` is the real one),
# which keeps `make drill` near 6 minutes on 2 cores; chaos still draws it, --scenario runs it.
DEFAULT_SCENARIOS = (*(k.value for k in planning.Kind if k != planning.Kind.SIGSTOP), planning.CHAOS)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "drill", help="kill, stop, hang, corrupt and preempt a real run, then judge the resume"
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=planning.SCENARIOS,
        help="run only this scenario (repeatable; default: all but sigstop, chaos last)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="drives fault steps, ranks and chaos; printed for replay"
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--hang-timeout", type=float, default=4.0, help="the watchdog's train-phase timeout")
    p.add_argument("--workdir", type=Path, default=Path("drill-runs") / time.strftime("%Y%m%d-%H%M%S"))
    p.set_defaults(func=run)


class _Progress:
    """Status lines for a CI log: every event, plus "still running" at most every 15 s."""

    EVERY_S = 15.0

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._last = time.monotonic()

    def __call__(self, msg: str, run: ScenarioRun) -> None:
        now = time.monotonic()
        if not msg and now - self._last < self.EVERY_S:
            return
        self._last = now
        step = run.records[-1].step if run.records else 0
        launches = len({r.launch for r in run.records})
        print(
            f"[drill] {run.scenario}: {msg or 'running'}: step {step}/{self.steps}, "
            f"faults {len(run.injected)}, restarts {max(launches - 1, 0)}",
            file=sys.stderr,
            flush=True,
        )


def run(args: argparse.Namespace) -> int:
    scenarios = args.scenario or list(DEFAULT_SCENARIOS)
    workdir: Path = args.workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise UserError(f"{workdir} is not empty; pass a new --workdir")
    cfg = DrillConfig(
        workdir=workdir,
        ranks=args.ranks,
        steps=args.steps,
        save_every=args.save_every,
        seed=args.seed,
        parallel=args.parallel,
        hang_timeout_s=args.hang_timeout,
    )
    try:
        plans = {
            s: planning.plan(
                s, seed=args.seed, steps=args.steps, save_every=args.save_every, ranks=args.ranks
            )
            for s in scenarios
        }
    except ValueError as e:  # an unknown scenario, a plan that does not fit --steps
        raise UserError(str(e)) from None
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "drill.log"
    started = time.monotonic()
    print(
        f"[drill] seed {args.seed}, {args.ranks} ranks, {args.steps} steps, save every {args.save_every}; "
        f"scenarios: {', '.join(scenarios)}; logs in {log}",
        file=sys.stderr,
        flush=True,
    )
    for s, faults in plans.items():
        print(f"[drill] plan {s}: " + "; ".join(f.describe() for f in faults), file=sys.stderr)
    print("[drill] golden run (uninterrupted torchrun)...", file=sys.stderr, flush=True)
    try:
        golden, golden_digest = run_golden(cfg, log)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.FOUND_PROBLEM
    runs: list[ScenarioRun] = []
    verdicts: list[Verdict] = []
    for s, faults in plans.items():
        print(f"[drill] {s}: starting under the watchdog", file=sys.stderr, flush=True)
        r = run_scenario(cfg, s, faults, log, _Progress(args.steps))
        v = judge(
            s,
            faults=faults,
            injected=r.injected,
            save_in_flight=r.save_in_flight,
            golden=golden,
            drill=r.records,
            steps=args.steps,
            save_every=args.save_every,
            golden_digest=golden_digest,
            drill_digest=r.digest,
            latest_violations=r.latest_violations,
            events=r.events,
            fault_times=r.fault_times,
        )
        print(f"[drill] {s}: {'PASS' if v.ok else 'FAIL'}", file=sys.stderr, flush=True)
        runs.append(r)
        verdicts.append(v)
    report = workdir / "report.md"
    png = workdir / "loss.png"
    plot(png, golden, runs, verdicts)
    settings = (
        f"seed {args.seed}, {args.ranks} ranks ({args.parallel}), {args.steps} steps, save every "
        f"{args.save_every}, hang timeout {args.hang_timeout:g}s; replay with `python -m supervisor drill "
        f"--seed {args.seed}" + "".join(f" --scenario {s}" for s in scenarios) + "`"
    )
    write_report(
        report,
        settings=settings,
        golden_digest=golden_digest,
        runs=runs,
        verdicts=verdicts,
        plot_name=png.name,
    )
    print(verdict_table(verdicts))
    ok = all(v.ok for v in verdicts)
    print(
        f"\n{'PASS' if ok else 'FAIL'}: {sum(v.ok for v in verdicts)} of {len(verdicts)} scenarios in "
        f"{human_duration(time.monotonic() - started)}. Report: {report} (plot: {png})"
    )
    if not ok:
        for v in verdicts:
            for f in v.failures():
                print(f"  {v.scenario}: {f}")
    return Exit.OK if ok else Exit.FOUND_PROBLEM

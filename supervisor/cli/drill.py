"""``python -m supervisor drill``: golden run, faulted runs under the watchdog, verdict, report.

Exit 0 only when every check of every scenario holds; 1 when any fails; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from supervisor.display import human_duration
from supervisor.drill import plan as planning
from supervisor.drill import storage
from supervisor.drill.faultctl import FaultFSError
from supervisor.drill.judge import Verdict, judge
from supervisor.drill.report import plot, summary, verdict_table, write_report
from supervisor.drill.runner import DrillConfig, ScenarioRun, run_golden, run_scenario
from supervisor.errors import UserError
from supervisor.format.exitcodes import Exit

# Every scenario but sigstop (a stop the watchdog's own SIGCONT cures; `hang` is the real one),
# which keeps `make drill` near 6 minutes on 2 cores; chaos still draws it, --scenario runs it.
# The storage scenarios need /dev/fuse and run when asked for: --storage, --scenario storage.
DEFAULT_SCENARIOS = (
    *(k.value for k in planning.Kind if k != planning.Kind.SIGSTOP and k not in planning.STORAGE),
    planning.CHAOS,
)
STORAGE_SCENARIOS = tuple(k.value for k in planning.STORAGE)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "drill", help="kill, stop, hang, corrupt and preempt a real run, then judge the resume"
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=(*planning.SCENARIOS, planning.STORAGE_GROUP),
        help="run only this scenario (repeatable; default: all but sigstop and the storage ones, chaos "
        f"last; '{planning.STORAGE_GROUP}': {', '.join(STORAGE_SCENARIOS)})",
    )
    p.add_argument(
        "--storage",
        action="store_true",
        help=f"also run the storage scenarios ({', '.join(STORAGE_SCENARIOS)}): the run dir on a fault "
        "filesystem; skipped, with the reason, where /dev/fuse is unavailable",
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
    p.add_argument(
        "--trainer",
        type=Path,
        default=None,
        metavar="SCRIPT",
        help="drill your own script (started by torchrun with --ckpt-root --steps --save-every --seed) "
        "instead of the reference trainer; e.g. examples/plain_loop.py",
    )
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


def chosen(asked: list[str] | None, with_storage: bool) -> list[str]:
    """The scenarios to run, in order, once each: those asked for (the default set when none),
    the storage group expanded, the storage scenarios added with --storage."""
    names = [*(asked or DEFAULT_SCENARIOS), *(STORAGE_SCENARIOS if with_storage else ())]
    expanded = (STORAGE_SCENARIOS if n == planning.STORAGE_GROUP else (n,) for n in names)
    return list(dict.fromkeys(n for group in expanded for n in group))


def run(args: argparse.Namespace) -> int:
    scenarios = chosen(args.scenario, args.storage)
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
        trainer=args.trainer,
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
    no_storage = storage.unavailable() if set(scenarios) & set(STORAGE_SCENARIOS) else None
    if no_storage:
        print(f"[drill] skipping the storage scenarios: {no_storage}", file=sys.stderr)
    print("[drill] golden run (uninterrupted torchrun)...", file=sys.stderr, flush=True)
    try:
        golden, golden_digest = run_golden(cfg, log)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.FOUND_PROBLEM
    runs: list[ScenarioRun] = []
    verdicts: list[Verdict] = []
    for s, faults in plans.items():
        if no_storage and s in STORAGE_SCENARIOS:
            verdicts.append(Verdict(s, (), skipped=no_storage))
            continue
        print(f"[drill] {s}: starting under the watchdog", file=sys.stderr, flush=True)
        try:
            r = run_scenario(cfg, s, faults, log, _Progress(args.steps))
        except FaultFSError as e:
            print(f"error: {s}: {e}", file=sys.stderr)
            return Exit.FOUND_PROBLEM
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
            storage=r.storage,
        )
        print(f"[drill] {s}: {v.result}", file=sys.stderr, flush=True)
        runs.append(r)
        verdicts.append(v)
    report = workdir / "report.md"
    png = workdir / "loss.png"
    plot_line = plot(png, golden, runs, verdicts)
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
        plot_line=plot_line,
    )
    print(verdict_table(verdicts))
    ok = all(v.ok for v in verdicts)
    print(
        f"\n{': '.join(summary(verdicts))} in {human_duration(time.monotonic() - started)}. Report: {report} "
        + (f"(plot: {png})" if png.exists() else "(no plot: matplotlib is not installed)")
    )
    if not ok:
        for v in verdicts:
            for f in v.failures():
                print(f"  {v.scenario}: {f}")
    return Exit.OK if ok else Exit.FOUND_PROBLEM

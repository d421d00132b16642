"""``python -m supervisor drill``: golden run, faulted runs under the watchdog, verdict, report.

Exit 0 only when every check of every scenario holds; 1 when any fails; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from supervisor import options
from supervisor.display import human_duration
from supervisor.drill import plan as planning
from supervisor.drill import storage
from supervisor.drill.faultctl import FaultFSError
from supervisor.drill.judge import Case, StepRecord, Verdict, judge
from supervisor.drill.report import json_report, plot, summary, verdict_table, write_report
from supervisor.drill.runner import DrillConfig, ScenarioRun, compare_with_golden, run_golden, run_scenario
from supervisor.errors import UserError
from supervisor.format.exitcodes import Exit

# Every scenario but sigstop (a stop the watchdog's own SIGCONT cures; `hang` is the real one),
# which keeps `make drill` near 6 minutes on 2 cores; chaos still draws it, --scenario runs it.
# The storage scenarios need /dev/fuse and run when asked for: --storage, --scenario storage. So do
# the hangs that need more than any run has (a user's trainer drilled with --ranks 2, maybe without
# DataLoader workers): hang-collective (3 ranks or more) and hang-loader (workers); chaos leaves
# them out too.
DEFAULT_SCENARIOS = (
    *(
        k.value
        for k in planning.Kind
        if k != planning.Kind.SIGSTOP and k not in planning.STORAGE and k not in planning.NOT_DRAWN
    ),
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
    options.add_options(p, DrillConfig)  # --seed, --ranks, --steps...: declared on DrillConfig
    p.add_argument(
        "--json",
        action="store_true",
        help='print the verdict as one JSON object ("schema": 1, docs/drill.md) instead of the table',
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
    cfg = options.build(DrillConfig, args, workdir=args.workdir.resolve())
    if cfg.workdir.exists() and any(cfg.workdir.iterdir()):
        raise UserError(f"{cfg.workdir} is not empty; pass a new --workdir")
    plans, unfit = _plans(cfg, scenarios, adapt=not args.scenario)
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    log = cfg.workdir / "drill.log"
    started = time.monotonic()
    _say(
        f"seed {cfg.seed}, {cfg.ranks} ranks, {cfg.steps} steps, save every {cfg.save_every}; "
        f"scenarios: {', '.join(scenarios)}; logs in {log}"
    )
    for s, faults in plans.items():
        _say(f"plan {s}: " + "; ".join(f.describe() for f in faults))
    for s, why in unfit.items():
        _say(f"skipping {s}: {why}")
    _say("golden run (uninterrupted torchrun)...")
    try:
        golden, golden_digest = run_golden(cfg, log)
        runs, verdicts = _scenarios(cfg, plans, golden, golden_digest, log)
        verdicts += [Verdict(s, (), skipped=why) for s, why in unfit.items()]
    except (RuntimeError, FaultFSError) as e:  # the golden run failed; the fault filesystem failed
        print(f"error: {e}", file=sys.stderr)
        return Exit.FOUND_PROBLEM
    report, png = cfg.workdir / "report.md", cfg.workdir / "loss.png"
    plot_line = plot(png, golden, runs, verdicts)
    settings = (
        f"seed {cfg.seed}, {cfg.ranks} ranks ({cfg.parallel}), {cfg.steps} steps, save every "
        f"{cfg.save_every}, hang timeout {cfg.hang_timeout_s:g}s; replay with `python -m supervisor drill "
        f"--seed {cfg.seed}" + "".join(f" --scenario {s}" for s in scenarios) + "`"
    )
    write_report(
        report,
        settings=settings,
        golden_digest=golden_digest,
        runs=runs,
        verdicts=verdicts,
        plot_line=plot_line,
    )
    took = time.monotonic() - started
    ok = all(v.ok for v in verdicts)
    if args.json:
        files = {"report": str(report), "plot": str(png) if png.exists() else None, "log": str(log)}
        doc = json_report(_settings_json(cfg, scenarios, took), golden_digest, runs, verdicts, files)
        print(json.dumps(doc, indent=1))
    else:
        _print_verdicts(verdicts, report, png, took)
    return Exit.OK if ok else Exit.FOUND_PROBLEM


def _plans(
    cfg: DrillConfig, scenarios: list[str], *, adapt: bool
) -> tuple[dict[str, list[planning.Fault]], dict[str, str]]:
    """Each scenario's faults. The default set (``adapt``) fits itself to --steps: fewer faults
    where there is no room for all, and a scenario with no room for any is skipped (with the
    reason); a scenario asked for by name that does not fit is refused (one line, exit 2)."""
    plans: dict[str, list[planning.Fault]] = {}
    unfit: dict[str, str] = {}
    for s in scenarios:
        try:
            plans[s] = planning.plan(
                s,
                seed=cfg.seed,
                steps=cfg.steps,
                save_every=cfg.save_every,
                ranks=cfg.ranks,
                adapt=adapt,
                preempt_as=cfg.preempt_as,
                num_workers=cfg.num_workers,
            )
        except ValueError as e:  # an unknown scenario, a plan that does not fit --steps or --ranks
            if not adapt:
                raise UserError(str(e)) from None
            unfit[s] = str(e)
    return plans, unfit


def _settings_json(cfg: DrillConfig, scenarios: list[str], took: float) -> dict[str, Any]:
    keys = ("seed", "ranks", "steps", "save_every", "parallel", "hang_timeout_s")
    return {
        **{k: getattr(cfg, k) for k in keys},
        "workdir": str(cfg.workdir),
        "scenarios": scenarios,
        "duration_s": round(took, 1),
    }


def _say(msg: str) -> None:
    print(f"[drill] {msg}", file=sys.stderr, flush=True)


def _scenarios(
    cfg: DrillConfig,
    plans: dict[str, list[planning.Fault]],
    golden: list[StepRecord],
    golden_digest: str,
    log: Path,
) -> tuple[list[ScenarioRun], list[Verdict]]:
    """Each scenario under the watchdog, judged against the golden run; the storage ones are
    skipped, with the reason, where the fault filesystem cannot run."""
    no_storage = storage.unavailable() if set(plans) & set(STORAGE_SCENARIOS) else None
    if no_storage:
        _say(f"skipping the storage scenarios: {no_storage}")
    runs: list[ScenarioRun] = []
    verdicts: list[Verdict] = []
    for s, faults in plans.items():
        if no_storage and s in STORAGE_SCENARIOS:
            verdicts.append(Verdict(s, (), skipped=no_storage))
            continue
        _say(f"{s}: starting under the watchdog")
        try:
            r = run_scenario(cfg, s, faults, log, _Progress(cfg.steps))
        except FaultFSError as e:
            raise FaultFSError(f"{s}: {e}") from None
        if r.digest is not None and r.digest != golden_digest:
            _say(f"{s}: the final digest differs from golden's: comparing the checkpoints")
            r.comparison = compare_with_golden(cfg, r)
        v = judge(
            Case(
                s,
                faults,
                r,
                golden,
                golden_digest,
                cfg.steps,
                cfg.save_every,
                hang_timeout_s=cfg.hang_timeout_s,
                memory_every=0 if cfg.trainer else 1,  # drivers.MemoryKill: every step, ours
            )
        )
        _say(f"{s}: {v.result}")
        runs.append(r)
        verdicts.append(v)
    return runs, verdicts


def _print_verdicts(verdicts: list[Verdict], report: Path, png: Path, took: float) -> None:
    print(verdict_table(verdicts))
    print(
        f"\n{': '.join(summary(verdicts))} in {human_duration(took)}. Report: {report} "
        + (f"(plot: {png})" if png.exists() else "(no plot: matplotlib is not installed)")
    )
    for v in verdicts:
        for f in v.failures():
            print(f"  {v.scenario}: {f}")

"""The drill's report: a verdict table for the terminal, and a Markdown file with the event timeline
and a PNG of the loss curves (golden vs drill, faults and resumes marked)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from supervisor.display import table
from supervisor.drill.judge import StepRecord, Verdict, fault_windows, short_digest
from supervisor.drill.runner import ScenarioRun
from supervisor.format import eventtypes as ev
from supervisor.format.eventnames import EventName
from supervisor.format.layout import step_dirname
from supervisor.redact import redact, redact_obj
from supervisor.store import list_tmp

# `drill --json`'s "schema": goes up when a field changes meaning (fields may be added without it).
DRILL_SCHEMA = 1

# Watchdog events worth showing between a fault and the first resumed step.
TIMELINE_EVENTS = (
    EventName.HANG,
    EventName.STACK_DUMP,
    EventName.STOP,
    EventName.KILL,
    EventName.LAUNCH_END,
    EventName.PREEMPT,
    EventName.QUARANTINE,
    EventName.PICK,
    EventName.LAUNCH,
    EventName.IO_RETRY,
    EventName.SAVE_FAILED,
    EventName.SAVE_RECOVERED,
)


def verdict_rows(verdicts: Sequence[Verdict], fail: str = "FAIL") -> list[tuple[str, str, str, str]]:
    """(scenario, result, check, detail) per check; a skipped scenario is one row with its reason."""
    rows = []
    for v in verdicts:
        if v.skipped:
            rows.append((v.scenario, "SKIPPED", "-", v.skipped))
        for i, c in enumerate(v.checks):
            rows.append((v.scenario if i == 0 else "", "PASS" if c.ok else fail, c.name, c.detail))
    return rows


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    return table(("scenario", "result", "check", "detail"), verdict_rows(verdicts))


def summary(verdicts: Sequence[Verdict]) -> tuple[str, str]:
    """PASS or FAIL, and how many of the scenarios that ran passed; skipped ones named apart."""
    ran = [v for v in verdicts if not v.skipped]
    skipped = [v.scenario for v in verdicts if v.skipped]
    counts = f"{sum(v.ok for v in ran)} of {len(ran)} scenarios"
    if skipped:
        counts += f" (skipped: {', '.join(skipped)})"
    return ("PASS" if all(v.ok for v in ran) else "FAIL"), counts


def resume_table(run: ScenarioRun, v: Verdict) -> str:
    in_flight = list_tmp(run.root)  # saves a fault interrupted: their writer died, so they stay
    rows = []
    for res, fault in zip(v.resumes, run.injected, strict=False):
        picks = [e for e in ev.every(run.events, ev.Pick) if e.t <= res.first_seen]
        used = picks[-1].event.checkpoint if picks else f"step {res.ckpt_step}"
        skipped = [  # the reason already names the checkpoint
            e.event.why for e in ev.every(run.events, ev.Quarantine) if e.t <= res.first_seen
        ]
        skipped += [
            f"{step_dirname(t.step)}: save in flight at the fault, left as {t.path.name} (never listed)"
            for t in in_flight
            if res.ckpt_step < t.step <= res.reached
        ]
        rows.append((fault.kind.value, used, res.reached, res.redone, "; ".join(skipped) or "-"))
    if not rows:
        return "No resume: the run had one launch."
    return _md_table(("fault", "resumed from", "had reached", "steps redone", "skipped, and why"), rows)


def timeline(run: ScenarioRun, v: Verdict) -> str:
    lines = []
    windows = fault_windows(run.events, run.fault_times, v.resumes)
    for i, (fault, t0, window) in enumerate(zip(run.injected, run.fault_times, windows, strict=True)):
        lines.append(f"**{fault.describe()}** (t0 = {time.strftime('%H:%M:%S', time.localtime(t0))})")
        lines.append("")
        for e in window:
            if e.event.NAME in TIMELINE_EVENTS:
                lines.append(f"- +{e.t - t0:6.2f}s  {e.event.NAME}: {e.msg}")
        if i < len(v.resumes):
            t_end = v.resumes[i].first_seen
            lines.append(
                f"- +{t_end - t0:6.2f}s  first resumed step seen (step {v.resumes[i].ckpt_step + 1})"
            )
        lines.append("")
    return "\n".join(lines)


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(out)


def plot(
    path: Path, golden: Sequence[StepRecord], runs: Sequence[ScenarioRun], verdicts: Sequence[Verdict]
) -> str:
    """One panel per scenario: golden loss as a thick line, the drill's as dots on top (each launch
    its own colour), faults as red dashed lines, resumes as green dotted lines. Returns the
    report's line for it: the image, or why there is none (matplotlib is optional: the verdict
    does not need it)."""
    try:
        import matplotlib
    except ImportError:
        return "No loss plot: matplotlib is not installed (`pip install matplotlib`, or the `drill` extra)."

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    verdicts = [v for v in verdicts if not v.skipped]  # a skipped scenario has no run
    n = max(len(runs), 1)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n), sharex=True, squeeze=False)
    gx = [r.step for r in golden]
    gy = [r.loss for r in golden]
    for ax, run, v in zip(axes[:, 0], runs, verdicts, strict=True):
        ax.plot(gx, gy, color="0.75", linewidth=4, label="golden (uninterrupted)")
        launches: list[str] = []
        for r in run.records:
            if r.launch not in launches:
                launches.append(r.launch)
        for i, launch in enumerate(launches):
            pts = [(r.step, r.loss) for r in run.records if r.launch == launch]
            # Hollow rings of shrinking size, so redone steps show every launch on the same point.
            ax.plot(
                *zip(*pts, strict=True),
                "o",
                markersize=max(7 - 2 * i, 2.5),
                fillstyle="none",
                label=f"drill launch {i + 1}",
            )
        for fault, t0 in zip(run.injected, run.fault_times, strict=True):
            at = max((r.step for r in run.records if r.seen <= t0), default=fault.at_step)
            ax.axvline(at, color="red", linestyle="--", linewidth=1)
            ax.text(at, max(gy), f" {fault.kind.value}", color="red", fontsize=7, va="top")
        for res in v.resumes:
            ax.axvline(res.ckpt_step, color="green", linestyle=":", linewidth=1.2)
        ax.set_title(f"{run.scenario}: {'PASS' if v.ok else 'FAIL'}", fontsize=9, loc="left")
        ax.set_ylabel("loss")
        ax.legend(fontsize=6, loc="upper right")
    axes[-1, 0].set_xlabel("step (red dashed: fault, green dotted: checkpoint resumed from)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"![loss curves]({path.name})"


def write_report(
    path: Path,
    *,
    settings: str,
    golden_digest: str,
    runs: Sequence[ScenarioRun],
    verdicts: Sequence[Verdict],
    plot_line: str,
) -> None:
    verdict, counts = summary(verdicts)
    parts = [
        "# Fault drill report",
        "",
        f"**Verdict: {verdict}** ({counts})",
        "",
        f"Settings: {settings}. Golden digest `{short_digest(golden_digest)}`.",
        "",
        "## Verdicts",
        "",
        _md_table(("scenario", "result", "check", "detail"), verdict_rows(verdicts, fail="**FAIL**")),
        "",
        plot_line,
        "",
    ]
    for run, v in zip(runs, [v for v in verdicts if not v.skipped], strict=True):
        parts += [f"## {run.scenario}", "", resume_table(run, v), "", "### What the drill did", ""]
        parts += [f"- {n}" for n in run.notes] + [""]
        parts += [
            f"`latest` read {run.latest_reads} times while the run went on; watchdog exit codes: "
            f"{', '.join(map(str, run.exit_codes))}.",
            "",
            "### Timeline",
            "",
            timeline(run, v),
        ]
    path.write_text(redact("\n".join(parts)))  # events and notes may quote a URL with credentials


def json_report(
    settings: dict[str, Any],
    golden_digest: str,
    runs: Sequence[ScenarioRun],
    verdicts: Sequence[Verdict],
    files: dict[str, str | None],
) -> dict[str, Any]:
    """``drill --json``: the verdict of every scenario and check, what was injected and resumed,
    for a CI job to read instead of the table (docs/drill.md)."""
    verdict, counts = summary(verdicts)
    by_scenario = {r.scenario: r for r in runs}
    return redact_obj(
        {  # notes and events may quote a URL with credentials
            "schema": DRILL_SCHEMA,
            "ok": verdict == "PASS",
            "verdict": verdict,
            "summary": counts,
            "settings": settings,
            "golden_digest": golden_digest,
            **files,
            "scenarios": [_scenario_json(v, by_scenario.get(v.scenario)) for v in verdicts],
        }
    )


def _scenario_json(v: Verdict, run: ScenarioRun | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "scenario": v.scenario,
        "result": v.result,
        "skipped": v.skipped or None,
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in v.checks],
        "resumes": [{**dataclasses.asdict(r), "redone": r.redone} for r in v.resumes],
    }
    if run is not None:
        doc |= {
            "digest": run.digest,
            "injected": [
                {
                    "kind": f.kind.value,
                    "at_step": f.at_step,
                    "rank": f.rank,
                    "corruption": f.corruption and f.corruption.value,
                }
                for f in run.injected
            ],
            "exit_codes": run.exit_codes,
            "notes": run.notes,
        }
    return doc

"""``python -m supervisor status --ckpt-root DIR [--json | --prometheus] [--watch [SECONDS]]``"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor import options
from supervisor import shared_options as shared
from supervisor.display import human_age, human_bytes, human_duration, printable, table
from supervisor.errors import UserError
from supervisor.options import option
from supervisor.report import FULL_RANKS, CheckpointRow, StatusReport, build_report
from supervisor.store import FOREIGN_LABEL, ForeignKind
from supervisor.watch import recovery

# Rank tables longer than this show only the ranks that need a look, plus a summary.
MAX_RANK_ROWS = 16
CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class StatusOptions:
    """``supervisor status``'s command line, declared once (supervisor/options.py)."""

    ckpt_root: Path = shared.ckpt_root()
    json: bool = shared.as_json(
        f"one JSON object (every rank listed up to {FULL_RANKS} ranks; above, those that need a look)"
    )
    prometheus: bool = option(
        "Prometheus text exposition (0.0.4): step, steps/s, launches, restarts, recovery by phase, "
        "checkpoint age, quarantined (docs/cli.md#metrics)",
        False,
    )
    all_ranks: bool = option("list every rank, however many (reads every node's records)", False)
    watch: float | None = option(
        "refresh every SECONDS (2): in place on a terminal, appended otherwise",
        None,
        metavar="SECONDS",
        const=2.0,
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status", help="where the run stands: state, launches, ranks, checkpoints", description=__doc__
    )
    options.add_options(p, StatusOptions)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        _run(args)
    except BrokenPipeError:  # `status | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _run(args: argparse.Namespace) -> None:
    if args.json and args.prometheus:
        raise UserError("--json and --prometheus: choose one format")
    if args.watch is None:
        # One report and out: the collector's passes over a big run's 10^4 new objects cost ~5 ms
        # and free nothing a process about to exit needs freed. `--watch` keeps it (runs for days).
        was = gc.isenabled()
        gc.disable()
        try:
            _show(build_report(args.ckpt_root, all_ranks=args.all_ranks), args)
        finally:
            if was:
                gc.enable()
        return
    while True:
        report = build_report(args.ckpt_root, all_ranks=args.all_ranks)
        if not (args.json or args.prometheus):  # redraw in place on a terminal; else one after another
            sys.stdout.write(CLEAR if sys.stdout.isatty() else f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        _show(report, args)
        sys.stdout.flush()
        time.sleep(max(args.watch, 0.2))


def _show(report: StatusReport, args: argparse.Namespace) -> None:
    if args.prometheus:
        from supervisor.prometheus import exposition

        sys.stdout.write(exposition(report))
        return
    # JSON escapes every control character itself; a person's table is made printable (a host, a
    # reason, a field of the run directory may hold ESC sequences)
    print(json.dumps(report.to_dict()) if args.json else printable(render(report)))


def _opt(v: object, fmt: Callable[[Any], str] = str) -> str:
    return "-" if v is None else fmt(v)


def render(r: StatusReport) -> str:
    out = [f"run {r.root}: {r.state.upper()}" + (f" - {r.why}" if r.why else "")]
    restarts = sum(n.restarts for n in r.nodes)
    launches = sum(n.launches for n in r.nodes)
    rate = "-" if r.steps_per_s is None else f"{r.steps_per_s:.2f}"
    out.append(
        f"step {_opt(r.current_step)}  steps/s {rate}  launches {launches}  restarts {restarts}  "
        f"disk {human_bytes(r.disk_bytes)}"
    )
    out += _node_lines(r)
    out += _launch_lines(r)
    out += ["", *_rank_lines(r)]
    out += ["", "checkpoints:", *_checkpoint_lines(r)]
    if r.storage_problem:
        out.append(f"STORAGE: {r.storage_problem}")
    if r.in_progress:
        out.append("being written: " + ", ".join(r.in_progress))
    if r.abandoned:
        out.append("abandoned, never committed: " + ", ".join(r.abandoned))
    if r.quarantined:
        out += ["", "quarantined:"]
        out.append(table(("name", "reason"), [(q.name, q.reason) for q in r.quarantined]))
    if r.remote:
        out += ["", _remote_line(r)]
    if r.stragglers:
        out += ["", "stragglers:", *(f"  {line}" for line in r.stragglers)]
    if r.slurm:
        out += ["", f"slurm {r.slurm}"]
    if r.roster:
        out.append(f"roster {r.roster}")
    if r.bad_nodes:
        out += ["bad nodes:", *(f"  {line}" for line in r.bad_nodes)]
    if r.retention:
        out += ["", f"retention: {r.retention}"]
    return "\n".join(out)


def _node_lines(r: StatusReport) -> list[str]:
    """One row per watchdog, when there is more than one or one has a problem."""
    if len(r.nodes) <= 1 and not any(n.problem or n.summary_stale for n in r.nodes):
        return []
    rows = [
        (
            n.node,
            n.host,
            n.watchdog_pid,
            n.status,
            n.launches,
            n.restarts,
            _summary_cell(n.summary_age_s, n.summary_stale),
            n.problem or n.reason,
        )
        for n in r.nodes
    ]
    return [
        "",
        "watchdogs:",
        table(("node", "host", "pid", "status", "launches", "restarts", "summary", "reason"), rows),
    ]


def _summary_cell(age: float | None, stale: bool) -> str:
    """The node summary's age: 'STALE 3m' when its watchdog stopped rewriting it."""
    if age is None:
        return "-"
    return f"STALE {human_age(age)}" if stale else human_age(age)


def _launch_lines(r: StatusReport) -> list[str]:
    if not r.launches:
        return []
    rows = [
        (
            f"{lr.node}:{lr.number}" if len(r.nodes) > 1 else lr.number,
            human_age(r.time - lr.started),
            human_duration(lr.duration_s),
            _opt(lr.resumed_from),
            _opt(lr.last_step),
            lr.outcome,
            lr.reason,
        )
        for lr in r.launches
    ]
    return [
        "",
        "recent launches:",
        table(("#", "started", "ran", "from", "died at", "outcome", "reason"), rows),
        *_recovery_lines(r),
    ]


def _recovery_lines(r: StatusReport) -> list[str]:
    """The last relaunch's recovery per watchdog: where its time went."""
    many = len(r.nodes) > 1
    return [
        f"last recovery{f' (node {n.node})' if many else ''}: {recovery.describe(n.recovery)}"
        for n in r.nodes
        if n.recovery
    ]


def _checkpoint_lines(r: StatusReport) -> list[str]:
    if not r.checkpoints:
        return ["  none"]
    rows = [
        (
            c.name,
            _opt(c.age_s, human_age),
            _opt(c.size_bytes, human_bytes),
            _CHECK.get(c.evidence, "INVALID") + ("" if c.valid else f": {c.reason}") + _foreign_note(c),
            "<- latest" if c.latest else "",
        )
        for c in r.checkpoints
    ]
    return [table(("name", "age", "size", "quick check", ""), rows)]


def _foreign_note(c: CheckpointRow) -> str:
    """Another trainer's checkpoint: whose, and whether its bytes are proven."""
    if not c.kind:
        return ""
    return f" ({FOREIGN_LABEL[ForeignKind(c.kind)]}" + (f"; {c.mark})" if c.valid else ")")


# Quick check column: "unknown" could not be read, which is not proof of corruption.
_CHECK = {"ok": "ok", "corrupt": "INVALID", "unknown": "UNKNOWN"}


def _remote_line(r: StatusReport) -> str:
    """One line on the remote tier, from the uploader's status file (no network call)."""
    s = r.remote
    assert s is not None
    line = (
        f"remote {s.url}: {s.state}, newest remote step {_opt(s.newest_remote)}, "
        f"lag {s.lag_steps} steps / {human_duration(s.lag_s)}"
    )
    if s.last_success_time:
        line += f", last upload {human_age(r.time - s.last_success_time)}"
    if s.last_error:
        line += f"; last error: {s.last_error}"
    return line


def _rank_lines(r: StatusReport) -> list[str]:
    c = r.rank_counts
    if not c.total:
        return ["ranks: no heartbeats"]
    shown = list(r.ranks)
    head = f"ranks ({c.total}):"
    if c.total > MAX_RANK_ROWS:
        stale = [x for x in shown if x.stale]
        span = f"steps {c.step_min}..{c.step_max}; " if c.step_min is not None else ""
        head = (
            f"ranks ({c.total}): {span}"
            + ", ".join(f"{n} {p}" for p, n in c.phases)
            + f"; {c.stale} stale or unknown"
            + (" (listed below)" if stale else "")
        )
        shown = stale[:MAX_RANK_ROWS]
    rows = [
        (
            x.rank,
            x.host,
            _opt(x.pid),
            _opt(x.step),
            f"{x.phase}  {x.progress}" if x.progress else x.phase,
            _opt(x.age_s, human_age),
            "STALE" if x.stale else "",
            x.note,
        )
        for x in shown
    ]
    return (
        [head, table(("rank", "host", "pid", "step", "phase", "heartbeat", "", "note"), rows)]
        if rows
        else [head]
    )

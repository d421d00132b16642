"""A run's status as Prometheus metrics: text exposition format 0.0.4, hand-written (torch-free, no
client library), for `status --prometheus` (a scrape, or a cron job) and `watch --metrics-file`
(node_exporter's textfile collector reads the file it keeps current).

Every metric is declared once here (``METRICS``) and carries the run's root as its ``run`` label,
so one collector can read many runs. A value the report does not have (no step yet, no valid
checkpoint, no recovery) is left out rather than written as 0: a dashboard then shows no data,
not a false zero. docs/grafana-dashboard.json charts them (docs/cli.md#metrics).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from supervisor.format.atomic import atomic_write_text
from supervisor.report import StatusReport

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "resumable_"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # gauge or counter
    help: str


METRICS = {
    m.name: m
    for m in (
        Metric("run_state", "gauge", "1 for the run's state (label state), as `status` judges it"),
        Metric("step", "gauge", "the newest step any live rank reported"),
        Metric("steps_per_second", "gauge", "training speed: 1 / the median step time of the live ranks"),
        Metric("launches_total", "counter", "launches of the trainer by the watchdogs, all nodes"),
        Metric("restarts_total", "counter", "relaunches after a failure, hang or preemption, all nodes"),
        Metric(
            "last_recovery_seconds",
            "gauge",
            "the last relaunch's recovery, seconds per phase (label phase; total: failure to first step)",
        ),
        Metric("checkpoint_step", "gauge", "the step of the newest valid checkpoint"),
        Metric("checkpoint_age_seconds", "gauge", "seconds since the newest valid checkpoint was written"),
        Metric("checkpoints", "gauge", "checkpoints by quick check (label status: ok, corrupt, unknown)"),
        Metric("quarantined_checkpoints", "gauge", "checkpoints moved to quarantine/ (corrupt, rolled back)"),
        Metric("ranks", "gauge", "ranks with a heartbeat"),
        Metric("ranks_stale", "gauge", "ranks whose heartbeat is stale or unreadable (hung, stopped, lost)"),
        Metric("disk_bytes", "gauge", "bytes the run directory's checkpoints and records take"),
    )
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _samples(r: StatusReport) -> Iterator[tuple[str, dict[str, str], float]]:
    yield "run_state", {"state": r.state}, 1
    if r.current_step is not None:
        yield "step", {}, r.current_step
    if r.steps_per_s is not None:
        yield "steps_per_second", {}, r.steps_per_s
    yield "launches_total", {}, sum(n.launches for n in r.nodes)
    yield "restarts_total", {}, sum(n.restarts for n in r.nodes)
    for n in r.nodes:
        for phase, seconds in n.recovery.items():
            yield "last_recovery_seconds", {"node": str(n.node), "phase": phase}, seconds
    valid = [c for c in r.checkpoints if c.valid]
    if valid:
        newest = max(valid, key=lambda c: c.step)
        yield "checkpoint_step", {}, newest.step
        if newest.age_s is not None:
            yield "checkpoint_age_seconds", {}, max(newest.age_s, 0.0)
    for status in ("ok", "corrupt", "unknown"):
        yield "checkpoints", {"status": status}, sum(c.evidence == status for c in r.checkpoints)
    yield "quarantined_checkpoints", {}, len(r.quarantined)
    yield "ranks", {}, r.rank_counts.total
    yield "ranks_stale", {}, r.rank_counts.stale
    yield "disk_bytes", {}, r.disk_bytes


def exposition(r: StatusReport) -> str:
    """The report as one scrape: HELP and TYPE once per metric, then its samples."""
    by_name: dict[str, list[str]] = {}
    for name, labels, value in _samples(r):
        pairs = ",".join(f'{k}="{_label(v)}"' for k, v in {"run": r.root, **labels}.items())
        by_name.setdefault(name, []).append(f"{PREFIX}{name}{{{pairs}}} {_number(value)}")
    lines = []
    for name, samples in by_name.items():
        m = METRICS[name]
        lines += [f"# HELP {PREFIX}{name} {m.help}", f"# TYPE {PREFIX}{name} {m.kind}", *samples]
    return "\n".join(lines) + "\n"


def write_textfile(path: Path, r: StatusReport) -> None:
    """Replace node_exporter's textfile atomically (it must never read half a file); its name
    must end in ``.prom`` for the collector to read it."""
    atomic_write_text(path, exposition(r))
    os.chmod(path, 0o644)  # the collector runs as another user

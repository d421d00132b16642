"""``metrics.jsonl``: one record per training step, appended by rank 0 across launches (so a resume
shows as a new ``launch`` whose first step follows its checkpoint). Defined once: trainers write
``MetricsRecord.to_line()``, the drill, tests and benchmarks read with ``parse_line``/``read_metrics``."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.format.capped import LOG_MAX, read_tail

# Keys of the record itself; every other key of a line is one of the trainer's own metrics.
_OWN = ("step", "loss", "lr", "grad_norm", "step_time", "restart_count", "launch")


@dataclass(frozen=True)
class MetricsRecord:
    step: int  # the step just trained (1-based)
    loss: float
    lr: float  # the learning rate it trained with
    grad_norm: float = 0.0
    step_time: float = 0.0  # seconds, data to optimizer step
    restart_count: int = 0  # the watchdog's restarts so far (the heartbeat's)
    launch: str = ""  # the launch id: records of one launch are consecutive
    extra: Mapping[str, float] = field(default_factory=dict)  # the trainer's other metrics

    @classmethod
    def of(cls, step: int, metrics: Mapping[str, float], restart_count: int, launch: str) -> MetricsRecord:
        """The record of a step from what a trainer passed (``Resumable.step_end``); a missing loss
        or lr is NaN (the drill judges both: pass them)."""
        m = dict(metrics)
        own = {k: float(m.pop(k)) for k in ("loss", "lr", "grad_norm", "step_time") if k in m}
        return cls(
            step,
            own.pop("loss", math.nan),
            own.pop("lr", math.nan),
            **own,
            restart_count=restart_count,
            launch=launch,
            extra={k: float(v) for k, v in m.items()},
        )

    def to_line(self) -> str:
        d = {k: getattr(self, k) for k in _OWN}
        return json.dumps({**d, **{k: v for k, v in self.extra.items() if k not in d}})


def parse_line(line: str | bytes) -> MetricsRecord | None:
    """The record of one line; None for a line that is not one (a line still being written, or
    cut short by a full disk: the appender never crashes a rank for it). Keys other than the
    record's own are the trainer's metrics (``extra``)."""
    try:
        d = json.loads(line)
        return MetricsRecord(
            step=int(d["step"]),
            loss=float(d["loss"]),
            lr=float(d["lr"]),
            grad_norm=float(d.get("grad_norm") or 0.0),
            step_time=float(d.get("step_time") or 0.0),
            restart_count=int(d.get("restart_count") or 0),
            launch=str(d.get("launch", "")),
            extra={k: float(v) for k, v in d.items() if k not in _OWN and isinstance(v, int | float)},
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
        return None


def read_metrics(path: Path) -> list[MetricsRecord]:
    """Every whole record of a metrics file, in file order ([] when there is none yet)."""
    try:
        text, cut = read_tail(path, LOG_MAX)  # a log grown past it: its newest records
    except FileNotFoundError:
        return []
    if cut:
        text = text.split(b"\n", 1)[-1]
    return [r for line in text.splitlines() if (r := parse_line(line)) is not None]


# How far back from its end a resumed step's record is looked for (``logged_since``): a launch's
# lines after the step it saved follow it, so its newest lines, near the end, tell.
TAIL_LOOK = 64 << 10


def logged_since(path: Path, step: int, launch: str) -> bool:
    """Whether ``launch`` logged ``step`` (the file's last ``TAIL_LOOK`` bytes hold a record of it
    at that step or later: a launch's lines are in step order)."""
    try:
        text, _cut = read_tail(path, TAIL_LOOK)
    except FileNotFoundError:
        return False
    return any(
        r is not None and r.launch == launch and r.step >= step for r in map(parse_line, text.splitlines())
    )

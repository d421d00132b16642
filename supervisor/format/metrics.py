"""``metrics.jsonl``: one record per training step, appended by rank 0 across launches (so a resume
shows as a new ``launch`` whose first step follows its checkpoint). Defined once: trainers write
``MetricsRecord.to_line()``, the drill, tests and benchmarks read with ``parse_line``/``read_metrics``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MetricsRecord:
    step: int  # the step just trained (1-based)
    loss: float
    lr: float  # the learning rate it trained with
    grad_norm: float = 0.0
    step_time: float = 0.0  # seconds, data to optimizer step
    restart_count: int = 0  # the watchdog's restarts so far (the heartbeat's)
    launch: str = ""  # the launch id: records of one launch are consecutive

    def to_line(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def parse_line(line: str | bytes) -> MetricsRecord | None:
    """The record of one line; None for a line that is not one (a line still being written, or
    cut short by a full disk: the appender never crashes a rank for it). Unknown keys are ignored,
    so records may gain fields."""
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
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_metrics(path: Path) -> list[MetricsRecord]:
    """Every whole record of a metrics file, in file order ([] when there is none yet)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return []
    return [r for line in text.splitlines() if (r := parse_line(line)) is not None]

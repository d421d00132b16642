"""The step-boundary hook (supervisor/format/hooks.py) of the save-fault sweep (tests/save_faults.py).

Loaded by every rank of a sweep's launch through ``$SUPERVISOR_BOUNDARY_HOOK``, it reads the sweep's
plan (``$SAVE_FAULT_PLAN``, a JSON file) and, at each step boundary:

- rank 0 sets the fault filesystem's rules of the save about to start (``When.STEP``: the save's
  own files and tmp dir, which nothing touches before it) or of its commit (``When.SAVE``: once the
  save has started, the previous save is committed, so a rule on ``latest`` or the run dir meets
  this save's commit first). The rule picks the failing operation (its ``skip`` window), never a
  time;
- every rank records what it agreed on the previous save: its heartbeat's failed saves in a row
  and last error (``Checkpointer._apply`` sets them on every rank from the one agreed outcome),
  rank 0 also ``latest``. ``When.SAVE`` of step S comes after the save of step S-1 was finished
  (the next save finishes the last one first), so that record is the outcome of save S-1 as that
  rank saw it.

Records go to ``records/rank_NNNNN.jsonl`` next to the plan, outside the faulted run directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor import store
from supervisor.drill.faultctl import Controller
from supervisor.format.heartbeat import read_heartbeat
from supervisor.format.hooks import RankOps, When
from supervisor.format.layout import HEARTBEAT_DIR_ENV, RunDir, heartbeat_filename

ENV_PLAN = "SAVE_FAULT_PLAN"


def records_dir(plan_path: Path) -> Path:
    return plan_path.parent / "records"


def hook(rank: int, launch: str, ops: RankOps) -> Callable[[int, When], None]:
    del ops  # the sweep enters no collective of its own
    plan_path = Path(os.environ[ENV_PLAN])
    plan: dict[str, Any] = json.loads(plan_path.read_text())
    root = Path(plan["root"])
    folder = Path(os.environ.get(HEARTBEAT_DIR_ENV) or RunDir.of(root).heartbeats)
    out = records_dir(plan_path) / f"rank_{rank:05d}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    faults = Controller(plan["control"])
    rules: dict[str, dict[str, Any]] = plan["rules"]  # str(step) -> {"when": ..., "rule": ...}

    def record(**fields: Any) -> None:
        with open(out, "a") as f:
            f.write(json.dumps({"launch": launch, "rank": rank, **fields}) + "\n")

    def at(step: int, when: When) -> None:
        planned = rules.get(str(step))
        if rank == 0 and planned is not None and planned["when"] == when.value:
            record(step=step, rule=faults.add(planned["rule"]))
        if when is When.SAVE:
            hb = read_heartbeat(folder / heartbeat_filename(rank), rank).heartbeat
            assert hb is not None, f"rank {rank}: no heartbeat of its own in {folder}"
            latest = store.read_latest(root) if rank == 0 else None
            record(outcome_of=step - 1, failures=hb.save_failures, error=hb.last_error, latest=latest)

    return at

"""The run directory: names and paths, the one truth shared by the watchdog and the trainer.

    ROOT/
      step_00000050/                 committed checkpoint: DCP shards, per-rank files, manifest.json
      step_00000100.tmp.<pid>.<host>/ a checkpoint being written; never listed as a checkpoint
      latest                         text pointer to the newest committed checkpoint (a hint only)
      quarantine/step_..-<utc>/      checkpoints found corrupt, with reason.txt; never deleted
      heartbeats/rank_00003.json     per-rank liveness
      heartbeats/stacks_rank_00003.txt  faulthandler stack dumps of that rank
      supervisor/                    the watchdog's state.json and events.jsonl
      .lock                          the root's mutation lock (pointer, quarantine, prune)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STEP_DIGITS = 8
STEP_PREFIX = "step_"
TMP_MARK = ".tmp."
LATEST = "latest"
QUARANTINE = "quarantine"
HEARTBEATS = "heartbeats"
SUPERVISOR = "supervisor"
LOCK = ".lock"
MANIFEST = "manifest.json"
REASON = "reason.txt"

_COMMITTED_RE = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS}}})$")
_TMP_RE = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS}}})\.tmp\.(\d+)\.([A-Za-z0-9_-]+)$")


def step_dirname(step: int) -> str:
    if step < 0 or step >= 10**STEP_DIGITS:
        raise ValueError(f"step {step} out of range for {STEP_DIGITS} digits")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_committed(name: str) -> int | None:
    """Step of a committed checkpoint directory name, or None if the name is not one."""
    m = _COMMITTED_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TmpName:
    step: int
    pid: int
    host: str


def tmp_dirname(step: int, pid: int, host: str) -> str:
    safe_host = re.sub(r"[^A-Za-z0-9_-]", "-", host) or "unknown"
    return f"{step_dirname(step)}{TMP_MARK}{pid}.{safe_host}"


def parse_tmp(name: str) -> TmpName | None:
    m = _TMP_RE.match(name)
    return TmpName(int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def heartbeat_filename(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def stack_dump_filename(rank: int) -> str:
    return f"stacks_rank_{rank:05d}.txt"


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run's checkpoint root."""

    root: Path

    @classmethod
    def of(cls, root: str | Path) -> RunDir:
        return cls(Path(root))

    @property
    def latest(self) -> Path:
        return self.root / LATEST

    @property
    def quarantine(self) -> Path:
        return self.root / QUARANTINE

    @property
    def heartbeats(self) -> Path:
        return self.root / HEARTBEATS

    @property
    def supervisor(self) -> Path:
        return self.root / SUPERVISOR

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    def checkpoint(self, step: int) -> Path:
        return self.root / step_dirname(step)

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / heartbeat_filename(rank)

    def stack_dump(self, rank: int) -> Path:
        return self.heartbeats / stack_dump_filename(rank)

"""The watchdog's record: ``supervisor/events.jsonl`` (append-only, one JSON object a line with a
``msg`` an operator can read) and ``supervisor/state.json`` (current state, atomic rewrite).

With one watchdog per node, node 0 writes ``state.json`` / ``events.jsonl`` and node N > 0 writes
``state.nodeN.json`` / ``events.nodeN.jsonl``, so no two processes ever write one file.
The restart budget lives in the state file so it survives a restart of the watchdog itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from supervisor.fsutil import atomic_write_json
from supervisor.layout import RunDir
from supervisor.policy import LaunchRecord, Outcome
from supervisor.redact import redact, redact_obj

STATE_VERSION = 1
# Launch records kept in the state file (the event log keeps every one).
KEEP_LAUNCHES = 50
STATE_GLOB = "state*.json"
EVENTS_GLOB = "events*.jsonl"

# Values of RunState.status.
RUNNING = "running"
RESTARTING = "restarting"
DONE = "done"
FAILED = "failed"
STOPPED = "stopped"
REQUEUED = "requeued"


def _suffix(node: int) -> str:
    return "" if node == 0 else f".node{node}"


def state_path(root: str | Path, node: int = 0) -> Path:
    return RunDir.of(root).supervisor / f"state{_suffix(node)}.json"


def events_path(root: str | Path, node: int = 0) -> Path:
    return RunDir.of(root).supervisor / f"events{_suffix(node)}.jsonl"


@dataclass(frozen=True)
class RunState:
    """One watchdog's view of its run; rewritten atomically on every change."""

    node: int = 0
    host: str = ""
    watchdog_pid: int = 0
    status: str = RESTARTING
    reason: str = ""
    exit_code: int | None = None
    command: tuple[str, ...] = ()
    launch_count: int = 0
    launch_id: str = ""
    child_pid: int | None = None
    launch_started: float | None = None
    restart_times: tuple[float, ...] = ()
    launches: tuple[LaunchRecord, ...] = ()
    timeouts: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    updated: float = 0.0
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["launches"] = [dict(asdict(r), outcome=r.outcome.value) for r in self.launches]
        return d

    def with_launch(self, rec: LaunchRecord) -> RunState:
        return replace(self, launches=(*self.launches, rec)[-KEEP_LAUNCHES:])


def parse_state(d: Any) -> RunState:
    """A RunState from parsed JSON; raise ValueError with a short reason when it is not one."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    try:
        launches = tuple(
            LaunchRecord(**dict(r, outcome=Outcome(r["outcome"]))) for r in d.get("launches", [])
        )
        fields = {k: v for k, v in d.items() if k in RunState.__dataclass_fields__}
        fields["launches"] = launches
        fields["command"] = tuple(str(c) for c in d.get("command", ()))
        fields["restart_times"] = tuple(float(t) for t in d.get("restart_times", ()))
        fields["timeouts"] = {str(k): float(v) for k, v in dict(d.get("timeouts", {})).items()}
        return RunState(**fields)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad field ({e})") from None


def read_state(path: str | Path) -> RunState | None:
    """The state file's content, or None when missing; ValueError when it is garbage."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return parse_state(json.loads(text))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None


def write_state(root: str | Path, state: RunState) -> None:
    path = state_path(root, state.node)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, redact_obj(replace(state, updated=time.time()).to_dict()))


class EventLog:
    """Appends events to the node's events.jsonl and echoes the message to stderr."""

    def __init__(self, root: str | Path, node: int = 0, echo: TextIO | None = sys.stderr) -> None:
        self.path = events_path(root, node)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.node = node
        self.echo = echo

    def emit(self, event: str, msg: str, **fields: Any) -> dict[str, Any]:
        now = time.time()
        rec = {
            "t": round(now, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "node": self.node,
            "event": event,
            "msg": redact(msg),  # a URL in a message or a field may carry credentials
            **redact_obj(fields),
        }
        line = json.dumps(rec, sort_keys=False, default=str) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.echo is not None:
            print(f"[supervisor {rec['time']}] {rec['msg']}", file=self.echo, flush=True)
        return rec


def read_events(path: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """Events in order; garbage lines are skipped, a missing file gives []. ``tail_bytes`` reads
    only the end of a long log (its first, possibly partial, line is dropped)."""
    try:
        with open(path, "rb") as f:
            if tail_bytes is not None:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - tail_bytes))
                data = f.read()
                if size > tail_bytes:
                    data = data.split(b"\n", 1)[-1]
            else:
                data = f.read()
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out

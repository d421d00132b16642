"""The watchdog's record: ``supervisor/events.jsonl`` (append-only, one JSON object a line with a
``msg`` an operator can read) and ``supervisor/state.json`` (current state, atomic rewrite).

With one watchdog per node, node 0 writes ``state.json`` / ``events.jsonl`` and node N > 0 writes
``state.nodeN.json`` / ``events.nodeN.jsonl``, so no two processes ever write one file.
The restart budget lives in the state file so it survives a restart of the watchdog itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from supervisor.format import confined
from supervisor.format.atomic import atomic_write_json
from supervisor.format.capped import LOG_MAX, RECORD_MAX, read_capped, read_from, read_tail
from supervisor.format.eventtypes import Event, Logged, parse
from supervisor.format.launches import LaunchRecord, Outcome
from supervisor.format.layout import RunDir
from supervisor.format.runstatus import RunStatus

STATE_VERSION = 1
# Launch records kept in the state file (the event log keeps every one).
KEEP_LAUNCHES = 50


def state_path(root: str | Path, node: int = 0) -> Path:
    return RunDir.of(root).state(node)


def events_path(root: str | Path, node: int = 0) -> Path:
    return RunDir.of(root).events(node)


@dataclass(frozen=True)
class RunState:
    """One watchdog's view of its run; rewritten atomically on every change."""

    node: int = 0
    host: str = ""
    watchdog_pid: int = 0
    status: RunStatus = RunStatus.RESTARTING
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
    # The last relaunch's recovery: seconds per phase, in order, and "total" (watch/recovery.py).
    recovery: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    updated: float = 0.0
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["launches"] = [dict(asdict(r), outcome=r.outcome.value) for r in self.launches]
        return d

    def with_launch(self, rec: LaunchRecord) -> RunState:
        return replace(self, launches=(*self.launches, rec)[-KEEP_LAUNCHES:])


# Field types of the state file, checked on read: a file another version (or a person) wrote
# with a wrong-typed field takes the unreadable path (state_unreadable, kept as .bad), never a
# traceback. float fields take ints too; "?" marks a field that may be null.
_STATE_TYPES = {
    "node": "int",
    "host": "str",
    "watchdog_pid": "int",
    "status": "str",
    "reason": "str",
    "exit_code": "int?",
    "launch_count": "int",
    "launch_id": "str",
    "child_pid": "int?",
    "launch_started": "float?",
    "started": "float",
    "updated": "float",
    "version": "int",
}
_LAUNCH_TYPES = {
    "number": "int",
    "launch_id": "str",
    "started": "float",
    "ended": "float",
    "reason": "str",
    "resumed_from": "int?",
    "newest_after": "int?",
    "last_step": "int?",
}


_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
}


def typed(d: dict[str, Any], types: dict[str, str], where: str) -> dict[str, Any]:
    """The known fields of ``d``, each checked against ``types`` ("int", "float", "str"; "?": may be
    null); ValueError naming the first wrong one. A float that is not finite (JSON's ``1e400``)
    is refused: no record of the run holds one, and arithmetic on it overflows."""
    out: dict[str, Any] = {}
    for key, kind in types.items():
        if key not in d:
            continue
        v = d[key]
        if v is None and kind.endswith("?"):
            out[key] = None
            continue
        base = kind.rstrip("?")
        allowed, noun = _KINDS[base]
        if (
            isinstance(v, bool)
            or not isinstance(v, allowed)
            or (isinstance(v, float) and not math.isfinite(v))
        ):
            raise ValueError(f"{where}'{key}' is {v!r}, not {noun}")
        out[key] = float(d[key]) if base == "float" else v  # d[key]: v is narrowed to object
    return out


def _list(d: dict[str, Any], key: str) -> list[Any]:
    v = d.get(key, [])
    if not isinstance(v, list):
        raise ValueError(f"'{key}' is {v!r}, not a list")
    return v


def parse_state(d: Any) -> RunState:
    """A RunState from parsed JSON; raise ValueError with a short reason when it is not one
    (not an object, a field of the wrong type, a bad launch record)."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    fields = typed(d, _STATE_TYPES, "")
    launches = []
    for i, r in enumerate(_list(d, "launches")):
        if not isinstance(r, dict):
            raise ValueError(f"launch record {i} is {r!r}, not an object")
        missing = sorted(set(_LAUNCH_TYPES) - set(r))
        if missing:
            raise ValueError(f"launch record {i} has no '{missing[0]}'")
        try:
            outcome = Outcome(r.get("outcome"))
        except ValueError:
            raise ValueError(f"launch record {i}: outcome {r.get('outcome')!r} is unknown") from None
        launches.append(LaunchRecord(**typed(r, _LAUNCH_TYPES, f"launch record {i}: "), outcome=outcome))
    try:
        fields["status"] = RunStatus(fields.get("status", RunStatus.RESTARTING.value))
    except ValueError:
        raise ValueError(
            f"'status' is {fields['status']!r}, not one of {[s.value for s in RunStatus]}"
        ) from None
    fields["launches"] = tuple(launches)
    command = _list(d, "command")
    if not all(isinstance(c, str) for c in command):
        raise ValueError(f"'command' is {command!r}, not a list of strings")
    fields["command"] = tuple(command)
    times = _list(d, "restart_times")
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) for t in times):
        raise ValueError(f"'restart_times' is {times!r}, not a list of numbers")
    fields["restart_times"] = tuple(float(t) for t in times)
    fields["timeouts"] = _numbers(d, "timeouts")
    fields["recovery"] = _numbers(d, "recovery")
    return RunState(**fields)


def _numbers(d: dict[str, Any], key: str) -> dict[str, float]:
    v = d.get(key, {})
    if not isinstance(v, dict) or any(
        isinstance(x, bool) or not isinstance(x, (int, float)) for x in v.values()
    ):
        raise ValueError(f"'{key}' is {v!r}, not an object of numbers")
    return {str(k): float(x) for k, x in v.items()}


def read_state(path: str | Path) -> RunState | None:
    """The state file's content, or None when missing; ValueError when it is garbage (an
    OSError reading it propagates: unreadable storage is not garbage)."""
    try:
        text = read_capped(path, RECORD_MAX)
    except FileNotFoundError:
        return None
    try:
        return parse_state(json.loads(text))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: {e}") from None


def write_state(root: str | Path, state: RunState) -> None:
    from supervisor.redact import redact_obj  # here: `status` reads state and writes none (logging)

    atomic_write_json(
        state_path(root, state.node), redact_obj(replace(state, updated=time.time()).to_dict()), root
    )


def say(line: str, stream: TextIO | None = None) -> None:
    """One line to stderr (or ``stream``) that never raises: the fallback when a file cannot be
    written must not fail in turn (a closed or full stderr)."""
    from supervisor.display import printable  # here: `status` reads events and never says one

    with contextlib.suppress(OSError, ValueError):
        print(printable(line), file=stream or sys.stderr, flush=True)


class EventLog:
    """Appends events to the node's events.jsonl and echoes the message to stderr.

    Best effort: the watchdog is the one process that must outlive a full disk or a failing
    server, so a failed append never raises. The message still reaches stderr, a note says the
    log is not being written (once per failure streak), and the unwritten lines are kept in
    memory (up to MAX_PENDING_BYTES) and appended, in order, with the next event that can be."""

    MAX_PENDING_BYTES = 4 << 20

    def __init__(
        self, root: str | Path, node: int = 0, echo: TextIO | None = sys.stderr, path: Path | None = None
    ) -> None:
        self.root = Path(root)
        self.path = path or events_path(root, node)  # ``path``: another log of the run (the job's)
        self.node = node
        self.echo = echo
        self.pending = bytearray()  # lines not yet appended (a short write leaves a tail here)
        self.dropped = 0  # events not kept while failing: the buffer was full
        self.error: OSError | None = None  # the current failure streak's first error

    def emit(self, event: Event, msg: str) -> dict[str, Any]:
        """Append ``event`` (format/eventtypes.py) with ``msg``, a line for an operator; returns the
        record as written."""
        from supervisor.redact import redact, redact_obj  # here: see write_state

        now = time.time()
        rec = {
            "t": round(now, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "node": self.node,
            "event": event.NAME,
            "msg": redact(msg),  # a URL in a message or a field may carry credentials
            **redact_obj(event.fields()),
        }
        line = (json.dumps(rec, sort_keys=False, default=str) + "\n").encode()
        if len(self.pending) + len(line) > self.MAX_PENDING_BYTES:
            self.flush()  # room for this one, if the log can be written again
        if len(self.pending) + len(line) <= self.MAX_PENDING_BYTES:
            self.pending += line
        else:
            self.dropped += 1
        if self.echo is not None:
            say(f"[supervisor {rec['time']}] {rec['msg']}", self.echo)
        self.flush()
        return rec

    def flush(self) -> bool:
        """Append what is pending; True when nothing is left."""
        if not self.pending:
            return True
        try:
            self._append()
        except OSError as e:
            if self.error is None:
                self.error = e
                say(
                    f"[supervisor] event log {self.path} not written ({e.strerror or e}); "
                    "events are kept in memory and appended once it can be written"
                )
            return False
        if self.error is not None:
            lost = f"; {self.dropped} events did not fit in memory and are lost" if self.dropped else ""
            say(f"[supervisor] event log {self.path} written again{lost}")
            self.error, self.dropped = None, 0
        return True

    def _append(self) -> None:
        fd = confined.open_append(self.root, self.path)  # through no link: never outside the run dir
        try:
            while self.pending:
                n = os.write(fd, self.pending)
                del self.pending[:n]
            os.fsync(fd)
        finally:
            os.close(fd)


def read_logged(path: str | Path, tail_bytes: int | None = None) -> list[Logged[Event]]:
    """The log's events, typed (format/eventtypes.py); lines that are not one are skipped."""
    return [e for e in map(parse, read_events(path, tail_bytes)) if e is not None]


def parse_lines(data: bytes) -> list[dict[str, Any]]:
    """The events of whole lines of a log; garbage lines are skipped."""
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def follow_events(path: str | Path, offset: int, cap: int = 4 << 20) -> tuple[list[dict[str, Any]], int]:
    """The events appended to the log at ``path`` since ``offset`` (whole lines, at most ``cap``
    bytes of them), and the offset to follow it from next; none (and ``offset``) when it cannot be
    read. A log that shrank (replaced) is followed from its start."""
    try:
        data, size = read_from(path, offset, cap)
    except OSError:
        return [], offset
    if size < offset:
        return follow_events(path, 0, cap)
    return parse_lines(data), offset + len(data)


def read_events(path: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """Events in order; garbage lines are skipped, a missing file gives []. ``tail_bytes`` reads
    only the end of a long log (its first, possibly partial, line is dropped)."""
    try:
        data, cut = read_tail(path, LOG_MAX if tail_bytes is None else min(tail_bytes, LOG_MAX))
    except OSError:
        return []
    if cut:
        data = data.split(b"\n", 1)[-1]
    return parse_lines(data)

"""The root-cause exception of a failed launch, from torchelastic's error files, without torch.

A worker whose entry point is wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``
writes the exception that killed it to ``$TORCHELASTIC_ERROR_FILE`` as JSON (torch's
``ErrorHandler.record_exception``)::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764500000"}}}

torchrun gives each worker its own file, ``<log dir>/<run id>/attempt_<n>/<local rank>/error.json``,
and copies the first failure's (earliest timestamp) into its own ``$TORCHELASTIC_ERROR_FILE`` with
an ``errorCode`` added, but only when it exits by itself: the watchdog kills the launch as soon as
a rank dies, so the workers' files are read first. Older torch wrote ``message`` as a plain string
with a top-level ``timestamp``. Files are parsed as JSON, size-capped; nothing in them is run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from supervisor.format.capped import read_capped
from supervisor.format.layout import ELASTIC_ERROR

MAX_ERROR_FILE_BYTES = 1 << 20  # a traceback; anything larger is not one of these files
MAX_MESSAGE_CHARS = 300  # the verdict is one line
_FRAME_RE = re.compile(r'File "([^"\n]+)", line (\d+), in ([^\n]+)')


@dataclass(frozen=True)
class RootCause:
    type: str  # the exception's class name ("ValueError"); "" when the message names none
    message: str  # its first line, capped
    file: str = ""  # the innermost frame of the traceback
    line: int = 0
    rank: int | None = None  # global rank (a worker's file, its local rank known from a heartbeat)
    local_rank: int | None = None  # from a worker's file's path
    timestamp: int = 0
    source: str = ""  # the file it was read from

    def describe(self) -> str:
        """'rank 1: ValueError: boom (train_ref/train.py:123)'."""
        who = ""
        if self.rank is not None:
            who = f"rank {self.rank}: "
        elif self.local_rank is not None:
            who = f"local rank {self.local_rank}: "
        what = f"{self.type}: {self.message}" if self.type else self.message
        at = f" ({self.file}:{self.line})" if self.file else ""
        return f"{who}{what}{at}"

    def fields(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "type": self.type,
            "message": self.message,
            "file": self.file,
            "line": self.line,
            "error_file": self.source,
        }


def parse_error_file(text: bytes | str) -> RootCause:
    """A RootCause from one error file's text; ValueError (a short reason) when it is not one."""
    try:
        d = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("not valid JSON") from None
    if not isinstance(d, dict) or "message" not in d:
        raise ValueError("no 'message' field: not a torchelastic error file")
    msg = d["message"]
    stack, stamp = "", d.get("timestamp", 0)
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        stack, stamp = str(extra.get("py_callstack", "")), extra.get("timestamp", 0)
        msg = msg.get("message", "")
    if not isinstance(msg, str):
        raise ValueError("'message' is neither text nor an object with a 'message'")
    first = (msg.strip().splitlines() or [""])[0]
    kind, sep, rest = first.partition(": ")
    if not (sep and kind.replace(".", "").replace("_", "").isalnum()):
        kind, rest = "", first
    frames = _FRAME_RE.findall(stack)
    try:
        file, line = (frames[-1][0], int(frames[-1][1])) if frames else ("", 0)
    except ValueError:  # more digits than int() takes
        file, line = frames[-1][0], 0
    try:
        timestamp = int(stamp)
    except (TypeError, ValueError, OverflowError):  # OverflowError: 1e400 parses as infinity
        timestamp = 0
    return RootCause(kind, rest[:MAX_MESSAGE_CHARS], file, line, timestamp=timestamp)


def _read(path: Path) -> RootCause:
    """Capped (a TooLarge is a ValueError), regular files only: a FIFO planted there never blocks."""
    rc = parse_error_file(read_capped(path, MAX_ERROR_FILE_BYTES))
    return replace(rc, source=str(path))


def errored_local_ranks(worker_logs: Path) -> set[int]:
    """Local ranks of the workers that wrote an error file (recorded the exception that ended
    them): names only, nothing read."""
    paths = worker_logs.glob(f"*/attempt_*/*/{ELASTIC_ERROR}") if worker_logs.is_dir() else []
    return {int(p.parent.name) for p in paths if p.parent.name.isdigit()}


def find_root_cause(
    error_file: Path, worker_logs: Path, global_rank: Mapping[int, int]
) -> tuple[RootCause | None, list[str]]:
    """The launch's root cause: the earliest of its workers' error files under ``worker_logs``
    (torchrun's rule; ``global_rank`` maps this host's local ranks to global ones, from their
    heartbeats), else the
    launched command's own ``error_file``; and one problem line per file that could not be used
    (named, with why: the verdict says so rather than guess)."""
    found: list[RootCause] = []
    problems: list[str] = []
    workers = sorted(worker_logs.glob(f"*/attempt_*/*/{ELASTIC_ERROR}")) if worker_logs.is_dir() else []
    for path in workers:
        try:
            rc = _read(path)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
            continue
        local = int(path.parent.name) if path.parent.name.isdigit() else None
        rank = global_rank.get(local) if local is not None else None
        found.append(replace(rc, rank=rank, local_rank=local))
    if found:
        return min(found, key=lambda r: (r.timestamp, r.local_rank or 0)), problems
    try:
        return _read(error_file), problems
    except FileNotFoundError:
        return None, problems
    except (OSError, ValueError) as e:
        return None, [*problems, f"{error_file}: {e}"]

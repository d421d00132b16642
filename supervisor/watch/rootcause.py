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
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format.capped import read_capped
from supervisor.format.heartbeat import Heartbeat
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
    at: float = 0.0  # when the file was written (its mtime: ``timestamp`` has whole seconds only)

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
    return replace(rc, source=str(path), at=os.stat(path).st_mtime)


def errored_local_ranks(worker_logs: Path) -> set[int]:
    """Local ranks of the workers that wrote an error file (recorded the exception that ended
    them): names only, nothing read."""
    paths = worker_logs.glob(f"*/attempt_*/*/{ELASTIC_ERROR}") if worker_logs.is_dir() else []
    return {int(p.parent.name) for p in paths if p.parent.name.isdigit()}


def worker_causes(worker_logs: Path, global_rank: Mapping[int, int]) -> tuple[list[RootCause], list[str]]:
    """Every worker's error file under ``worker_logs`` (``global_rank`` maps this host's local
    ranks to global ones, from their heartbeats), and one problem line per file that could not be
    used (named, with why)."""
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
    return found, problems


def find_root_cause(
    error_file: Path, worker_logs: Path, global_rank: Mapping[int, int]
) -> tuple[RootCause | None, list[str]]:
    """The launch's root cause as the error files tell it: the earliest of its workers' under
    ``worker_logs`` (torchrun's rule), else the launched command's own ``error_file``; and one
    problem line per file that could not be used (the verdict says so rather than guess).
    ``first_failures`` weighs them with the ranks that wrote none."""
    found, problems = worker_causes(worker_logs, global_rank)
    if found:
        return min(found, key=lambda r: (r.timestamp, r.at, r.local_rank or 0)), problems
    try:
        return _read(error_file), problems
    except FileNotFoundError:
        return None, problems
    except (OSError, ValueError) as e:
        return None, [*problems, f"{error_file}: {e}"]


# What a rank gone without an exception and without an exit code died of, when nothing more is known.
KILLED = (
    "killed by a signal (no exception recorded, no exit code): SIGKILL (signal 9)? the OOM killer "
    "or an operator"
)


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a failed launch ended, and when: of an exception (its last heartbeat's
    ``died_of``, or its error file) at ``t``; or, gone with neither and without an exit code,
    killed by a signal (``signal``) some time after ``t``, its last beat. Every rank that beats runs
    Resumable, which records an uncaught exception in both (supervisor/resumable/_signals.py):
    nothing else ends a Python process without one."""

    rank: int
    pid: int
    step: int
    t: float
    how: str
    signal: bool = False

    def describe(self) -> str:
        """'rank 1 (pid 77) at step 18: RuntimeError: boom (t.py:40)'."""
        return f"rank {self.rank} (pid {self.pid}) at step {self.step}: {self.how}"


def rank_ends(
    beats: Iterable[Heartbeat],
    gone: Collection[int],
    causes: Iterable[RootCause] = (),
    killed: Callable[[Heartbeat], str] = lambda hb: KILLED,
) -> list[RankEnd]:
    """How each rank that failed ended: those ``gone`` (vanished without an exit code), and those
    whose heartbeat or error file names the exception that ended them; ``killed`` says what is
    known of a rank killed by a signal (the OOM killer's word, when readable). First to fail
    first: an exception at its time, a signal at its rank's last beat, the earliest it can have
    struck (so a kill is never ranked after the error it caused in its peers), ties to the signal."""
    by_rank = {c.rank: c for c in causes if c.rank is not None}
    ends = []
    for hb in beats:
        cause = by_rank.get(hb.rank)
        if hb.died_of:
            ends.append(RankEnd(hb.rank, hb.pid, hb.step, hb.wall_time, hb.died_of))
        elif cause is not None:
            what = f"{cause.type}: {cause.message}" if cause.type else cause.message
            at = f" ({cause.file}:{cause.line})" if cause.file else ""
            ends.append(RankEnd(hb.rank, hb.pid, hb.step, cause.at or hb.wall_time, what + at))
        elif hb.rank in gone:
            ends.append(RankEnd(hb.rank, hb.pid, hb.step, hb.wall_time, killed(hb), signal=True))
    return sorted(ends, key=lambda e: (e.t, not e.signal, e.rank))


def ends_event(launch: int, problems: list[str], ends: Sequence[RankEnd]) -> ev.RootCause:
    """The root_cause event of a launch whose first failing rank is ``ends[0]``: the others' ends
    are its consequences."""
    first = ends[0]
    return ev.RootCause(
        launch=launch,
        problems=problems,
        rank=first.rank,
        pid=first.pid,
        step=first.step,
        how=first.how,
        signal=first.signal,
        consequences=[e.describe() for e in ends[1:]],
        failed_at=round(first.t, 3),
    )


def file_event(launch: int, problems: list[str], cause: RootCause) -> ev.RootCause:
    """The root_cause event of an exception read from torchelastic's error file."""
    return ev.RootCause(
        launch=launch,
        problems=problems,
        rank=cause.rank,
        local_rank=cause.local_rank,
        type=cause.type,
        message=cause.message,
        file=cause.file,
        line=cause.line,
        error_file=cause.source,
        failed_at=round(cause.at, 3) if cause.at else 0.0,
    )


def describe_ends(ends: Sequence[RankEnd]) -> str:
    """The first failure, then the others as its consequences, in one line."""
    if not ends:
        return ""
    first, rest = ends[0], ends[1:]
    then = f"; then, as a consequence: {'; '.join(e.describe() for e in rest)}" if rest else ""
    return first.describe() + then

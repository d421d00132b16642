"""Per-rank heartbeat files: written atomically by the trainer, read as frozen snapshots.

A reader never crashes on a garbage, half-written or missing file: it gets a snapshot whose
``heartbeat`` is None and whose ``problem`` says why, so the watchdog and ``status`` can show it
as unknown. A writer never crashes its rank either: a failed write (a full disk, EIO) is counted
and retried at the next beat.

Beats are driven by progress: a step done, or bytes read or written in a long I/O phase (verify,
load, commit...). Silence therefore means *no progress*, whatever the size of the checkpoint, and
that is what the watchdog calls a hang.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any

from supervisor.format.atomic import atomic_write_json, hostname
from supervisor.format.layout import (
    HEARTBEAT_DIR_ENV,
    HEARTBEATS,
    RunDir,
    heartbeat_filename,
    parse_heartbeat_filename,
    stack_dump_filename,
)

# Set by the watchdog for each launch, read by the trainer's HeartbeatWriter.
ENV_LAUNCH_ID = "SUPERVISOR_LAUNCH_ID"
ENV_RESTART_COUNT = "SUPERVISOR_RESTART_COUNT"


log = logging.getLogger(__name__)


class Phase(str, Enum):
    """What a rank is doing; each phase has its own no-progress timeout (policy.PhaseTimeouts)."""

    STARTUP = "startup"  # imports, rendezvous, process group, choosing a checkpoint, building the model
    VERIFY = "verify"  # checking a checkpoint's files (deep: every checksum)
    DOWNLOAD = "download"  # fetching a checkpoint from the remote tier
    LOAD = "load"  # reading a checkpoint into memory
    TRAIN = "train"
    SAVE = "save"  # writing a checkpoint (the part the training loop waits for)
    COMMIT = "commit"  # fsync, manifest, rename, latest
    DIGEST = "digest"  # the final parameter digest
    DONE = "done"


@cache
def boot_id() -> str:
    """This boot of this host: monotonic times are comparable only between equal boot ids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    local_rank: int
    host: str
    pid: int
    step: int
    phase: Phase
    wall_time: float
    restart_count: int = 0
    world_size: int = 0
    last_step_s: float = 0.0
    launch_id: str = ""
    exit_code: int | None = None
    # Progress inside the phase (bytes or units; total 0 when unknown) and the file being read or
    # written, so a rank stuck on one file is named with it.
    progress: int = 0
    progress_total: int = 0
    io_path: str = ""
    # time.monotonic() of the writer, and its host's boot: ages on one host use this clock.
    mono_time: float = 0.0
    boot_id: str = ""
    # Consecutive failed saves and the last error, for the watchdog's events and `status`.
    save_failures: int = 0
    last_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["phase"] = self.phase.value
        return d


@dataclass(frozen=True)
class HeartbeatSnapshot:
    """What one heartbeat file said when it was read; ``heartbeat`` is None when unreadable."""

    rank: int
    path: str
    heartbeat: Heartbeat | None
    problem: str = ""
    # The file's JSON object as read, every field kept (a node summary carries it as it is, so
    # fields this reader does not know still travel).
    record: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def known(self) -> bool:
        return self.heartbeat is not None


def heartbeat_folder(root: str | Path, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a rank writes its heartbeat: the node-local folder its watchdog named in the
    environment, else (a rank run without a watchdog) the run directory's heartbeats/."""
    return Path(environ[HEARTBEAT_DIR_ENV]) if environ.get(HEARTBEAT_DIR_ENV) else RunDir.of(root).heartbeats


def stack_dump_path(root: str | Path, rank: int) -> Path:
    """Where a rank's faulthandler writes its stacks on SIGUSR2: next to its heartbeat, so the
    watchdog of its node reads it (its text goes into the event log) and the shared filesystem
    gets no file per rank per launch."""
    return heartbeat_folder(root) / stack_dump_filename(rank)


def write_heartbeat(root: str | Path, hb: Heartbeat) -> None:
    """Into the run directory (a rank without a watchdog, tests, benchmarks)."""
    write_heartbeat_in(RunDir.of(root).heartbeats, hb)


def write_heartbeat_in(folder: Path, hb: Heartbeat) -> None:
    path = folder / heartbeat_filename(hb.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, hb.to_dict())


def parse_heartbeat(text: str | bytes) -> Heartbeat:
    """Raise ValueError (with a short reason) unless ``text`` is a complete heartbeat."""
    return heartbeat_from_dict(load_object(text))


def load_object(text: str | bytes) -> dict[str, Any]:
    """A JSON object, or ValueError with a short reason."""
    try:
        d = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: garbage like "[[[[..."
        raise ValueError("not valid JSON") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    return d


def heartbeat_from_dict(d: Mapping[str, Any]) -> Heartbeat:
    """Raise ValueError (with a short reason) unless ``d`` is a complete heartbeat record."""
    try:
        return Heartbeat(
            rank=_int(d["rank"]),
            local_rank=_int(d["local_rank"]),
            host=str(d["host"]),
            pid=_int(d["pid"]),
            step=_int(d["step"]),
            phase=Phase(d["phase"]),
            wall_time=_float(d["wall_time"]),
            restart_count=_int(d.get("restart_count", 0)),
            world_size=_int(d.get("world_size", 0)),
            last_step_s=_float(d.get("last_step_s", 0.0)),
            launch_id=str(d.get("launch_id", "")),
            exit_code=None if d.get("exit_code") is None else _int(d["exit_code"]),
            progress=_int(d.get("progress", 0)),
            progress_total=_int(d.get("progress_total", 0)),
            io_path=str(d.get("io_path", "")),
            mono_time=_float(d.get("mono_time", 0.0)),
            boot_id=str(d.get("boot_id", "")),
            save_failures=_int(d.get("save_failures", 0)),
            last_error=str(d.get("last_error", "")),
        )
    except KeyError as e:
        raise ValueError(f"field {e} missing") from None
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: float(10**400)
        raise ValueError(f"bad field ({e})") from None


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _float(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{v!r} is not a number")
    return float(v)


def read_small(path: str | Path) -> bytes:
    """Whole file via os.read: half the cost of open().read(), which matters for `status` over
    thousands of ranks."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_heartbeat(path: str | Path, rank: int) -> HeartbeatSnapshot:
    try:
        record = load_object(read_small(path))
        hb = heartbeat_from_dict(record)
    except FileNotFoundError:
        return HeartbeatSnapshot(rank, str(path), None, "missing")
    except OSError as e:
        return HeartbeatSnapshot(rank, str(path), None, f"unreadable ({e.strerror})")
    except ValueError as e:
        return HeartbeatSnapshot(rank, str(path), None, str(e))
    if hb.rank != rank:
        return HeartbeatSnapshot(rank, str(path), None, f"file of rank {rank} says rank {hb.rank}")
    return HeartbeatSnapshot(rank, str(path), hb, record=record)


def read_heartbeats(root: str | Path) -> list[HeartbeatSnapshot]:
    """Snapshots of every ``rank_NNNNN.json`` under the root's heartbeat folder, by rank (ranks
    run without a watchdog; supervisor.format.nodesummary reads a whole run)."""
    return read_heartbeat_folder(os.path.join(root, HEARTBEATS))


def read_heartbeat_folder(folder: str | Path) -> list[HeartbeatSnapshot]:
    """Snapshots of every ``rank_NNNNN.json`` in ``folder``, by rank."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out = []
    for name in names:
        rank = parse_heartbeat_filename(name)
        if rank is not None:
            out.append(read_heartbeat(os.path.join(folder, name), rank))
    return sorted(out, key=lambda s: s.rank)


class HeartbeatWriter:
    """Throttled writer for one rank: at most one write per ``interval_s`` within a phase, and
    always on a phase change, so thousands of ranks do not flood a shared filesystem. Never raises
    for a failed write: the rank keeps training and the next beat tries again."""

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        restart_count: int | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.root = Path(root)
        self.folder = heartbeat_folder(root)
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.restart_count = (
            int(os.environ.get(ENV_RESTART_COUNT, "0")) if restart_count is None else restart_count
        )
        self.launch_id = os.environ.get(ENV_LAUNCH_ID, "")
        self.interval_s = interval_s
        # Shown in every beat; the trainer sets them when a save fails or succeeds.
        self.save_failures = 0
        self.last_error = ""
        self.write_errors = 0  # failed writes in the current streak (0: the last write landed)
        self._host = hostname()
        self._pid = os.getpid()
        self._last_write = float("-inf")
        self._last_phase: Phase | None = None

    def beat(
        self,
        step: int,
        phase: Phase,
        last_step_s: float = 0.0,
        force: bool = False,
        exit_code: int | None = None,
        *,
        progress: int = 0,
        total: int = 0,
        io_path: str = "",
    ) -> bool:
        """Write a heartbeat if due; return whether one was written. A deliberate exit passes
        ``exit_code`` (always written) so the watchdog can classify it past torchrun's exit 1."""
        now, mono = time.time(), time.monotonic()
        due = (
            force
            or exit_code is not None
            or phase != self._last_phase
            or mono - self._last_write >= self.interval_s
        )
        if not due:
            return False
        hb = Heartbeat(
            rank=self.rank,
            local_rank=self.local_rank,
            host=self._host,
            pid=self._pid,
            step=step,
            phase=phase,
            wall_time=now,
            restart_count=self.restart_count,
            world_size=self.world_size,
            last_step_s=last_step_s,
            launch_id=self.launch_id,
            exit_code=exit_code,
            progress=progress,
            progress_total=total,
            io_path=io_path,
            mono_time=mono,
            boot_id=boot_id(),
            save_failures=self.save_failures,
            last_error=self.last_error,
        )
        self._last_phase = phase
        try:
            write_heartbeat_in(self.folder, hb)
        except OSError as e:
            if self.write_errors == 0:
                log.warning("rank %d: heartbeat not written (%s); retrying at the next beat", self.rank, e)
            self.write_errors += 1
            return False
        if self.write_errors:
            log.warning(
                "rank %d: heartbeat written again after %d failed writes", self.rank, self.write_errors
            )
            self.write_errors = 0
        self._last_write = mono
        return True

    def tracker(self, phase: Phase, step: int, total: int = 0) -> Progress:
        """Progress of one long phase: call it with the bytes (or units) just done; it beats when
        due, so the watchdog sees progress, and goes silent when progress stops."""
        return Progress(self, phase, step, total)


class Progress:
    """A ``ProgressFn`` (``(n) -> None``, as supervisor.format.manifest uses) that beats a heartbeat."""

    def __init__(self, writer: HeartbeatWriter, phase: Phase, step: int, total: int) -> None:
        self.writer, self.phase, self.step, self.total = writer, phase, step, total
        self.done = 0
        self.path = ""
        self._beat(force=True)

    def __call__(self, n: int) -> None:
        self.done += n
        self._beat()

    def set_path(self, path: str) -> None:
        """The file now being read or written (named in a hang verdict if it never returns). A new
        file is written at once, throttle or not: a read that blocks on it must find the heartbeat
        written before it naming it, not the previous file (one write per file opened in a long
        phase; clearing the path waits for the next due beat)."""
        new = bool(path) and path != self.path
        self.path = path
        self._beat(force=new)

    def _beat(self, force: bool = False) -> None:
        self.writer.beat(
            self.step, self.phase, force=force, progress=self.done, total=self.total, io_path=self.path
        )

"""Per-rank heartbeat files: written atomically by the trainer, read as frozen snapshots.

A reader never crashes on a garbage, half-written or missing file: it gets a snapshot whose
``heartbeat`` is None and whose ``problem`` says why, so the watchdog and ``status`` can show it
as unknown. A writer never crashes its rank either: a failed write (a full disk, EIO) is counted
and retried at the next beat.

Progress is what advances, not what is written: a heartbeat carries the progress of its phase (the
step in train, bytes or items in a long I/O phase: verify, load, save, commit...) and when that
last changed (``progress_mono``, ``progress_wall``). The watchdog measures silence from that
change, so a rank that keeps writing beats while nothing advances (a wait for its peers, for
background work, a backoff) still goes silent, whatever the size of the checkpoint, and that is
what the watchdog calls a hang. Such a wait says so in its beats (``waiting``) with the moment it
gives up on its own (``wait_until``): `status` shows it, and the watchdog holds a waiting rank to
the progress of its launch's other ranks (a rank done with its share, waiting for the slowest, is
not the culprit while that one advances).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from supervisor.format.atomic import atomic_write_json, hostname
from supervisor.format.capped import RECORD_MAX, read_capped
from supervisor.format.layout import (
    HEARTBEAT_DIR_ENV,
    HEARTBEATS,
    RunDir,
    heartbeat_filename,
    parse_heartbeat_filename,
    stack_dump_filename,
)

if TYPE_CHECKING:
    import logging


# Set by the watchdog for each launch, read by the trainer's HeartbeatWriter.
ENV_LAUNCH_ID = "SUPERVISOR_LAUNCH_ID"
ENV_RESTART_COUNT = "SUPERVISOR_RESTART_COUNT"
# Set for a pre-started (standby) launch (watch --standby): its ranks wait, imports done, until
# this file exists, or exit 0 once the watchdog with this pid is gone.
ENV_STANDBY_RELEASE = "SUPERVISOR_STANDBY_RELEASE"
ENV_WATCHDOG_PID = "SUPERVISOR_WATCHDOG_PID"
# Set by the watchdog for each launch: its phase timeouts (JSON: Phase value -> seconds), so that
# the ranks bound their own waits (collectives, backoffs) well under them.
ENV_PHASE_TIMEOUTS = "SUPERVISOR_PHASE_TIMEOUTS"

# Default phase timeouts: seconds a rank may go without progress in each phase (the watchdog's
# flags, supervisor/watch/liveness.py). Train is the tight one; startup covers a cold start
# (imports, rendezvous); the I/O phases count bytes, so their timeouts bound a stall, not the size
# of a checkpoint.
DEFAULT_TRAIN_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_VERIFY_TIMEOUT_S = 300.0
DEFAULT_DOWNLOAD_TIMEOUT_S = 300.0
DEFAULT_LOAD_TIMEOUT_S = 600.0
DEFAULT_SAVE_TIMEOUT_S = 900.0
DEFAULT_COMMIT_TIMEOUT_S = 300.0
DEFAULT_DIGEST_TIMEOUT_S = 300.0
# Each beat carries the rank's last steps' timings (``StepTime``): enough to cover the steps between
# two beats (one a second) of a fast loop, small enough that a beat stays ~1 KB.
STEP_TIMES_KEPT = 32


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
    CUSTOM = "custom"  # the trainer's own phase (eval, data refresh): name and timeout in the beat
    DONE = "done"


class Mark(str, Enum):
    """Moments of a launch's start, as wall times in its heartbeats (``marks``), so the watchdog
    can break a recovery down: which part of "kill -9 -> first step again" takes the time."""

    WORKER_STARTED = "worker_started"  # the rank's process was created
    TORCH_IMPORTED = "torch_imported"  # its imports are done
    RENDEZVOUS_DONE = "rendezvous_done"  # the process group is up
    STATE_LOADED = "state_loaded"  # the checkpoint is loaded (or there was none)
    FIRST_STEP = "first_step"  # its first step of this launch is done (HeartbeatWriter marks it)


@dataclass(frozen=True)
class StepTime:
    """How one step went on one rank, for the straggler verdict (supervisor/watch/stragglers.py):
    ``compute_s`` from the step's start (the previous step boundary, where every rank leaves
    together) to the rank's arrival at the step's collective, and ``wait_s`` spent in the step
    boundary's reduction waiting for the others. ``marked``: the trainer said where its own
    collective starts (``Resumable.compute_done``); without it the arrival is the boundary's
    reduction, and a rank that waited inside the trainer's own collectives counts that wait as
    compute. Written as ``[step, compute_s, wait_s, marked]``."""

    step: int
    compute_s: float
    wait_s: float
    marked: bool = False

    def to_list(self) -> list[float | int]:
        return [self.step, self.compute_s, self.wait_s, int(self.marked)]


def _step_times(v: object) -> tuple[StepTime, ...]:
    if not isinstance(v, list):
        raise ValueError(f"step_times {v!r:.60} is not a list")
    out = []
    for item in v:
        if not isinstance(item, list) or len(item) != 4:
            raise ValueError(f"step_times entry {item!r:.60} is not [step, compute_s, wait_s, marked]")
        out.append(StepTime(_int(item[0]), _float(item[1]), _float(item[2]), bool(_int(item[3]))))
    return tuple(out)


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
    """One rank's record of where it is (step, phase, progress), rewritten as it goes: what hang
    detection and `status` read."""

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
    # Phase CUSTOM only: the trainer's name for it and the silence it allows (0: the train timeout).
    phase_name: str = ""
    phase_timeout_s: float = 0.0
    # Mark value -> wall time, for the watchdog's recovery breakdown.
    marks: dict[str, float] = field(default_factory=dict)
    # When the progress (phase, step, ``progress``, ``io_path``) last changed, on the writer's clocks
    # (0: a writer that predates them; its beats are aged by ``mono_time``/``wall_time``).
    progress_mono: float = 0.0
    progress_wall: float = 0.0
    # What the rank waits for while it beats without progress ('' : not waiting), and the wall
    # time its wait gives up on its own (0: unknown).
    waiting: str = ""
    wait_until: float = 0.0
    # The exception that ended the rank, one line ("RuntimeError: ... (train.py:88)"), written by
    # its last beat (supervisor/resumable/_signals.py): a rank gone without it, and without an
    # exit code, was killed by a signal.
    died_of: str = ""
    # The rank's last steps (``StepTime``, oldest first, at most STEP_TIMES_KEPT).
    step_times: tuple[StepTime, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["phase"] = self.phase.value
        d["step_times"] = [t.to_list() for t in self.step_times]
        return d

    @property
    def label(self) -> str:
        """The phase as operators read it: a custom phase by its own name."""
        return self.phase_name if self.phase is Phase.CUSTOM and self.phase_name else self.phase.value


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
    write_heartbeat_in(RunDir.of(root).heartbeats, hb, root)


def write_heartbeat_in(folder: Path, hb: Heartbeat, within: str | Path | None = None) -> None:
    """Into ``folder``, made when missing, through no link below ``within`` (the run directory;
    by default ``folder``'s parent, as a node-local folder is handed over: confined.py)."""
    atomic_write_json(folder / heartbeat_filename(hb.rank), hb.to_dict(), within or folder.parent)


def parse_heartbeat(text: str | bytes) -> Heartbeat:
    """Raise ValueError (with a short reason) unless ``text`` is a complete heartbeat."""
    return heartbeat_from_dict(load_object(text))


def load_object(text: str | bytes) -> dict[str, Any]:
    """A JSON object, or ValueError with a short reason. Bytes are decoded as UTF-8 here, which
    every writer of these files writes: ``json.loads`` of bytes first guesses the encoding in
    Python, 3 of its 8 us on a node summary's header (`status` parses 2,048)."""
    try:
        d = json.loads(text.decode() if isinstance(text, bytes) else text)
    except (ValueError, RecursionError):  # RecursionError: garbage like "[[[[..."; ValueError: not UTF-8
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
            phase_name=str(d.get("phase_name", "")),
            phase_timeout_s=_float(d.get("phase_timeout_s", 0.0)),
            marks=_marks(d.get("marks", {})),
            progress_mono=_float(d.get("progress_mono", 0.0)),
            progress_wall=_float(d.get("progress_wall", 0.0)),
            waiting=str(d.get("waiting", "")),
            wait_until=_float(d.get("wait_until", 0.0)),
            died_of=str(d.get("died_of", "")),
            step_times=_step_times(d.get("step_times", [])),
        )
    except KeyError as e:
        raise ValueError(f"field {e} missing") from None
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: float(10**400)
        raise ValueError(f"bad field ({e})") from None


def _marks(v: object) -> dict[str, float]:
    if not isinstance(v, dict):
        raise ValueError(f"marks {v!r} is not an object")
    return {str(k): _float(t) for k, t in v.items()}


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _float(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{v!r} is not a number")
    return float(v)


def _log() -> logging.Logger:
    """This module's logger; logging is imported on the first warning: `status` reads heartbeats
    and pays 5 ms for an import it never uses."""
    import logging

    return logging.getLogger(__name__)


def read_heartbeat(path: str | Path, rank: int) -> HeartbeatSnapshot:
    try:
        record = load_object(read_capped(path, RECORD_MAX))
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
    for a failed write: the rank keeps training and the next beat tries again. It stamps when the
    progress (phase, step, ``progress``, the file it is in) last changed, at the call that changed
    it, written or not: a beat that changes nothing is no progress. A file opened or closed is
    progress: a rank that waited on its peers between files (held to its launch's progress, its
    own standing still) and goes on to its next file is not silent since before its wait."""

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
        # what a write may not leave: the run directory, or where the node-local folder was handed
        self.within = self.root if self.folder.is_relative_to(self.root) else self.folder.parent
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
        # The trainer's own phase, written with every beat in phase CUSTOM (``custom_phase``).
        self.custom: tuple[str, float] = ("", 0.0)
        # Shown in every beat: when this launch reached each Mark (the trainer's own; FIRST_STEP here).
        self.marks: dict[str, float] = {}
        self.write_errors = 0  # failed writes in the current streak (0: the last write landed)
        self._host = hostname()
        self._pid = os.getpid()
        self._last_write = float("-inf")
        self._last_phase: tuple[Phase, tuple[str, float]] | None = None
        self._progress: tuple[object, ...] | None = None  # (phase, custom, step, progress, file) last beaten
        self._progress_at = (0.0, 0.0)  # (monotonic, wall) of its last change
        self._last_step = 0
        self._died_of = ""
        # The last steps' timings, written with every beat (the trainer's Resumable keeps them).
        self.step_times: tuple[StepTime, ...] = ()

    def beat(  # noqa: PLR0913  the record's fields, keyword-only past the first five
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
        waiting: str = "",
        wait_until: float = 0.0,
    ) -> bool:
        """Write a heartbeat if due; return whether one was written. A deliberate exit passes
        ``exit_code`` (always written) so the watchdog can classify it past torchrun's exit 1.
        A beat made while waiting (for peers, background work, a backoff) says what for in
        ``waiting`` and when the wait gives up in ``wait_until`` (wall time; 0: unknown)."""
        now, mono = time.time(), time.monotonic()
        custom = self.custom if phase is Phase.CUSTOM else ("", 0.0)
        key = (phase, custom, step, progress, io_path)
        if key != self._progress:
            self._progress, self._progress_at = key, (mono, now)
        first_step = phase == Phase.TRAIN and last_step_s > 0 and Mark.FIRST_STEP.value not in self.marks
        if first_step:  # written at once: the watchdog times the recovery by it
            self.marks[Mark.FIRST_STEP.value] = now
        due = (
            force
            or first_step
            or exit_code is not None
            or (phase, custom) != self._last_phase
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
            phase_name=custom[0],
            phase_timeout_s=custom[1],
            marks=dict(self.marks),
            progress_mono=self._progress_at[0],
            progress_wall=self._progress_at[1],
            waiting=waiting,
            wait_until=wait_until,
            died_of=self._died_of,
            step_times=self.step_times,
        )
        self._last_phase, self._last_step = (phase, custom), step
        try:
            write_heartbeat_in(self.folder, hb, self.within)
        except OSError as e:
            if self.write_errors == 0:
                _log().warning("rank %d: heartbeat not written (%s); retrying at the next beat", self.rank, e)
            self.write_errors += 1
            return False
        if self.write_errors:
            _log().warning(
                "rank %d: heartbeat written again after %d failed writes", self.rank, self.write_errors
            )
            self.write_errors = 0
        self._last_write = mono
        return True

    def died(self, what: str) -> None:
        """The rank's last beat, on its way out: the exception that ended it (one line), at the
        step and phase of the beat before."""
        self._died_of = what
        phase = self._last_phase[0] if self._last_phase else Phase.STARTUP
        self.beat(self._last_step, phase, force=True)

    def mark(self, mark: Mark, at: float | None = None) -> None:
        """Record when this launch reached ``mark`` (now by default; the first time only); the
        next beat carries it."""
        self.marks.setdefault(mark.value, time.time() if at is None else at)

    def tracker(self, phase: Phase, step: int, total: int = 0) -> Progress:
        """Progress of one long phase: call it with the bytes (or units) just done; it beats when
        due, so the watchdog sees progress, and goes silent when progress stops."""
        return Progress(self, phase, step, total)


class Tracker(Protocol):
    """Where long work reports: called with the units (bytes, files) just done, told the path it
    is on (a hang verdict names it), and told when the work waits instead (for its peers: no
    progress, said so). ``Progress`` beats a heartbeat; the library's ``Relay`` counts for a
    thread that must not write one."""

    def __call__(self, n: int) -> None: ...

    def set_path(self, path: str) -> None: ...

    def wait(self, what: str, until: float = 0.0) -> None:
        """A beat while waiting for ``what``, no progress; ``until``: the wall time the wait
        gives up on its own (0: unknown)."""
        ...


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

    def wait(self, what: str, until: float = 0.0) -> None:
        self._beat(waiting=what, wait_until=until)

    def _beat(self, force: bool = False, waiting: str = "", wait_until: float = 0.0) -> None:
        self.writer.beat(
            self.step,
            self.phase,
            force=force,
            progress=self.done,
            total=self.total,
            io_path=self.path,
            waiting=waiting,
            wait_until=wait_until,
        )

"""How long a rank may stay silent, and how silent it is: the phase timeouts, the clock that ages
heartbeats and node summaries, and the one-rank verdicts `status` shows. Pure: time is passed in.
Kept apart from the detectors and the restart policy so that `status`, which needs only these,
imports a few classes, not the watchdog's decisions."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Protocol

from supervisor.format.heartbeat import (
    DEFAULT_COMMIT_TIMEOUT_S,
    DEFAULT_DIGEST_TIMEOUT_S,
    DEFAULT_DOWNLOAD_TIMEOUT_S,
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_SAVE_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TRAIN_TIMEOUT_S,
    DEFAULT_VERIFY_TIMEOUT_S,
    Heartbeat,
    Phase,
)
from supervisor.options import POSITIVE, option

# Phase timeouts: seconds a rank may go without progress (steps, or bytes and items in the long
# I/O phases), declared with the heartbeat (supervisor/format/heartbeat.py); the launch gets them
# in its environment (ENV_PHASE_TIMEOUTS) to bound its own waits under them.
# Learned train timeout (as NVIDIA resiliency-ext, off unless --learn-hang-timeout FACTOR): max
# observed step time x factor, never below the floor (it covers the heartbeat writer's throttle).
DEFAULT_LEARN_FLOOR_S = 10.0


def _timeout(default: float, what: str, flag: str) -> float:
    """A phase's timeout field, and its ``watch`` flag."""
    return option(f"seconds without progress in {what}", default, flag=flag, check=POSITIVE)


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds without progress allowed in each phase (field names are Phase values)."""

    train: float = _timeout(DEFAULT_TRAIN_TIMEOUT_S, "the train phase (a step)", "--hang-timeout")
    startup: float = _timeout(
        DEFAULT_STARTUP_TIMEOUT_S,
        "startup (imports, rendezvous, building the model), or before any heartbeat",
        "--startup-timeout",
    )
    verify: float = _timeout(
        DEFAULT_VERIFY_TIMEOUT_S, "verify (checking a checkpoint's files)", "--verify-timeout"
    )
    download: float = _timeout(
        DEFAULT_DOWNLOAD_TIMEOUT_S, "download (from the remote tier)", "--download-timeout"
    )
    load: float = _timeout(DEFAULT_LOAD_TIMEOUT_S, "load (reading a checkpoint)", "--load-timeout")
    save: float = _timeout(DEFAULT_SAVE_TIMEOUT_S, "save (writing a checkpoint)", "--save-timeout")
    commit: float = _timeout(DEFAULT_COMMIT_TIMEOUT_S, "commit (fsync, manifest, rename)", "--commit-timeout")
    digest: float = _timeout(
        DEFAULT_DIGEST_TIMEOUT_S, "digest (the final parameter digest)", "--digest-timeout"
    )

    def for_phase(self, phase: Phase) -> float | None:
        """Seconds a rank may stay silent in ``phase``; None: never hung (it is done). A custom
        phase that declares no timeout of its own is held to the train timeout."""
        if phase is Phase.CUSTOM:
            return self.train
        return None if phase == Phase.DONE else getattr(self, phase.value)

    def for_beat(self, hb: Heartbeat) -> float | None:
        """``for_phase``, but a custom phase (eval, data refresh) by the timeout its beat declares."""
        if hb.phase is Phase.CUSTOM and hb.phase_timeout_s > 0:
            return hb.phase_timeout_s
        return self.for_phase(hb.phase)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> PhaseTimeouts:
        """Timeouts as a state file recorded them; unknown names are ignored, missing ones default,
        a value that is not a positive number is a ValueError."""
        known = {f.name for f in fields(cls)}
        out: dict[str, float] = {}
        for k, v in d.items():
            if k in known:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                    raise ValueError(f"timeout '{k}' is {v!r}, not a positive number")
                out[k] = float(v)
        return cls(**out)


def learned_train_timeout(step_times: Iterable[float], factor: float, floor: float) -> float | None:
    """max observed step time x factor, at least ``floor``; None before any step was seen."""
    seen = [t for t in step_times if t > 0]
    return max(floor, max(seen) * factor) if seen else None


def effective_timeouts(base: PhaseTimeouts, learned_train: float | None) -> PhaseTimeouts:
    """Use the learned train timeout once there is one."""
    if learned_train is None:
        return base
    return replace(base, train=learned_train)


class Stamped(Protocol):
    """Something written at a time: a heartbeat, a node summary."""

    @property
    def wall_time(self) -> float: ...
    @property
    def mono_time(self) -> float: ...
    @property
    def boot_id(self) -> str: ...


@dataclass(frozen=True)
class Clock:
    """The watchdog's "now". A heartbeat written on this host during this boot is aged on the
    monotonic clock (an NTP step or a wall-clock jump must not fake a hang or hide one); one from
    another host, or an old one without ``mono_time``, on wall time."""

    wall: float
    mono: float = 0.0
    boot_id: str = ""

    def age(self, hb: Stamped) -> float:
        if self.boot_id and hb.boot_id == self.boot_id and hb.mono_time > 0:
            return self.mono - hb.mono_time
        return self.wall - hb.wall_time

    def silence(self, hb: Heartbeat) -> float:
        """Seconds since ``hb``'s progress last changed (its age when it says nothing of that):
        beats that changed nothing are no progress."""
        if not (hb.progress_mono or hb.progress_wall):
            return self.age(hb)
        if self.boot_id and hb.boot_id == self.boot_id and hb.progress_mono > 0:
            return self.mono - hb.progress_mono
        return self.wall - hb.progress_wall


def silences(beats: Sequence[Heartbeat], clock: Clock) -> list[float]:
    """Each rank's seconds without progress (``Clock.silence``), by ``beats``' order. A rank that
    says it waits (for its peers, for background work) is held to its launch's progress: its
    silence is the least of its launch's ranks', so a rank done with its share is no hang while
    the slowest still advances, and when nothing advances anywhere (ranks waiting for each other
    in different collectives) every waiting rank goes silent with the others."""
    own = [clock.silence(hb) for hb in beats]
    least: dict[str, float] = {}
    for hb, s in zip(beats, own, strict=True):
        least[hb.launch_id] = min(s, least.get(hb.launch_id, s))
    return [min(s, least[hb.launch_id]) if hb.waiting else s for hb, s in zip(beats, own, strict=True)]


def rank_stale(hb: Heartbeat, age: float, limit: float | None, current: Collection[str]) -> tuple[bool, str]:
    """Whether a rank needs a look for its silence, and the note that says why: from an earlier
    launch than the current ones, or silent past its phase's timeout (a finished rank never)."""
    old_launch = bool(current) and hb.launch_id not in current
    stale = hb.phase != Phase.DONE and (old_launch or (limit is not None and age > limit))
    note = "from an earlier launch" if old_launch else (f"silent > {limit:g}s" if stale else "")
    return stale, note


def describe_wait(hb: Heartbeat, wall: float) -> str:
    """'waiting for peers (gives up in 12s)'; '' when the rank is not waiting."""
    if not hb.waiting:
        return ""
    if hb.wait_until <= 0:
        return f"waiting for {hb.waiting}"
    left = hb.wait_until - wall
    return f"waiting for {hb.waiting} ({f'gives up in {left:.0f}s' if left >= 0 else f'{-left:.0f}s past its own deadline'})"


def describe_progress(progress: int, total: int, io_path: str) -> str:
    """'45% at step_00000120/__1_0.distcp' (a count where the total is unknown); '' when the
    heartbeat carries neither."""
    parts = []
    if total > 0:
        parts.append(f"{100 * progress // total}%")
    elif progress > 0:
        parts.append(f"{progress} done")
    if io_path:
        parts.append(f"at {io_path}")
    return " ".join(parts)

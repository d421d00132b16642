"""Run directory -> a frozen report of where the run stands, for a person or a script.

Only reads (no lock, no torch): the watchdogs' state files, heartbeats, checkpoints (quick check:
manifest and file sizes), quarantine, disk use. A garbage file never stops it; it shows as unknown
with the reason. So does storage that does not answer: a checkpoint that cannot be read is
"unknown" (not invalid), a directory that cannot be listed is named in ``storage_problem``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor import store
from supervisor.format import events
from supervisor.format.atomic import hostname, pid_alive
from supervisor.format.heartbeat import Phase, boot_id, read_heartbeats
from supervisor.format.layout import STATE_GLOB, RunDir
from supervisor.ioerrors import describe
from supervisor.watch.restart_policy import Clock, PhaseTimeouts, describe_progress

if TYPE_CHECKING:
    from supervisor.tiers.uploader import RemoteStatus

UNKNOWN = "unknown"
# Worst first: the run's state is the worst of its nodes' states.
_SEVERITY = (events.FAILED, events.STOPPED, events.REQUEUED, events.RESTARTING, events.RUNNING, events.DONE)
RECENT_LAUNCHES = 10


# `status --json`'s layout: raised when a field changes meaning or goes away (new fields do not).
STATUS_SCHEMA = 1


@dataclass(frozen=True)
class NodeRow:
    node: int
    host: str
    watchdog_pid: int
    status: str
    reason: str
    exit_code: int | None
    launches: int
    restarts: int
    launch_id: str
    problem: str = ""
    # The last relaunch's recovery, seconds per phase and "total" (supervisor/watch/recovery.py).
    recovery: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchRow:
    node: int
    number: int
    started: float
    duration_s: float
    outcome: str
    reason: str
    resumed_from: int | None
    last_step: int | None


@dataclass(frozen=True)
class RankRow:
    rank: int
    host: str
    pid: int | None
    step: int | None
    phase: str
    age_s: float | None
    last_step_s: float | None
    stale: bool
    note: str
    progress: str = ""  # in a long I/O phase: '45% at step_00000120/__1_0.distcp'
    save_failures: int = 0  # failed saves in a row the rank reports
    last_error: str = ""


@dataclass(frozen=True)
class CheckpointRow:
    name: str
    step: int
    age_s: float | None
    size_bytes: int | None
    valid: bool
    reason: str
    latest: bool
    evidence: str = "ok"  # ok, corrupt or unknown (could not be read: not proof of corruption)


@dataclass(frozen=True)
class QuarantineRow:
    name: str
    reason: str


@dataclass(frozen=True)
class StatusReport:
    root: str
    time: float
    state: str
    why: str
    nodes: tuple[NodeRow, ...]
    launches: tuple[LaunchRow, ...]
    ranks: tuple[RankRow, ...]
    current_step: int | None
    steps_per_s: float | None
    checkpoints: tuple[CheckpointRow, ...]
    in_progress: tuple[str, ...]
    quarantined: tuple[QuarantineRow, ...]
    disk_bytes: int
    remote: RemoteStatus | None = None  # the uploader's last word (remote.json); no network call
    storage_problem: str = ""  # the checkpoints or the quarantine could not be listed, and why
    slurm: str = ""  # sbatch/job.sh's requeue budgets (supervisor/slurm.json), one line; "" if none

    def to_dict(self) -> dict[str, Any]:
        """Shallow per row: ``dataclasses.asdict`` deep-copies and costs 10x on 4096 ranks."""
        d = {"schema": STATUS_SCHEMA, **self.__dict__}
        for key in ("nodes", "launches", "ranks", "checkpoints", "quarantined"):
            d[key] = [row.__dict__ for row in d[key]]
        d["in_progress"] = list(self.in_progress)
        d["remote"] = dict(self.remote.__dict__, skipped=list(self.remote.skipped)) if self.remote else None
        return d


def _nodes(root: Path) -> tuple[list[NodeRow], list[LaunchRow], dict[str, float], set[str]]:
    """Node rows, recent launches, the phase timeouts in force, and the current launch ids."""
    nodes: list[NodeRow] = []
    launches: list[LaunchRow] = []
    timeouts: dict[str, float] = {}
    current: set[str] = set()
    me = hostname()
    for path in sorted(RunDir.of(root).supervisor.glob(STATE_GLOB)):
        try:
            st = events.read_state(path)
        except ValueError as e:
            nodes.append(NodeRow(-1, "", 0, UNKNOWN, "", None, 0, 0, "", problem=str(e)))
            continue
        except OSError as e:
            nodes.append(NodeRow(-1, "", 0, UNKNOWN, "", None, 0, 0, "", problem=f"{path}: {describe(e)}"))
            continue
        if st is None:
            continue
        status, reason = st.status, st.reason
        if status in (events.RUNNING, events.RESTARTING) and st.host == me and not pid_alive(st.watchdog_pid):
            status, reason = (
                events.FAILED,
                f"watchdog pid {st.watchdog_pid} is gone (its state said: {reason})",
            )
        nodes.append(
            NodeRow(
                st.node,
                st.host,
                st.watchdog_pid,
                status,
                reason,
                st.exit_code,
                st.launch_count,
                len(st.restart_times),
                st.launch_id,
                recovery=st.recovery,
            )
        )
        timeouts = timeouts or st.timeouts
        if status == events.RUNNING:
            current.add(st.launch_id)
        launches += [
            LaunchRow(
                st.node,
                r.number,
                r.started,
                r.ended - r.started,
                r.outcome.value,
                r.reason,
                r.resumed_from,
                r.last_step,
            )
            for r in st.launches[-RECENT_LAUNCHES:]
        ]
    launches.sort(key=lambda r: r.started)
    return nodes, launches[-RECENT_LAUNCHES:], timeouts, current


def _ranks(root: Path, clock: Clock, timeouts: PhaseTimeouts, current: set[str]) -> list[RankRow]:
    rows = []
    for snap in read_heartbeats(root):
        hb = snap.heartbeat
        if hb is None:
            rows.append(RankRow(snap.rank, "", None, None, UNKNOWN, None, None, True, snap.problem))
            continue
        age = clock.age(hb)
        limit = timeouts.for_phase(hb.phase)
        old_launch = bool(current) and hb.launch_id not in current
        stale = hb.phase != Phase.DONE and (old_launch or (limit is not None and age > limit))
        note = "from an earlier launch" if old_launch else (f"silent > {limit:g}s" if stale else "")
        if hb.exit_code is not None:
            note = (note + "; " if note else "") + f"exit code {hb.exit_code}"
        if hb.save_failures:
            note = (note + "; " if note else "") + f"{hb.save_failures} failed saves: {hb.last_error}"
        progress = (
            ""
            if hb.phase in (Phase.TRAIN, Phase.DONE)
            else describe_progress(hb.progress, hb.progress_total, hb.io_path)
        )
        rows.append(
            RankRow(
                hb.rank,
                hb.host,
                hb.pid,
                hb.step,
                hb.phase.value,
                age,
                hb.last_step_s,
                stale,
                note,
                progress,
                hb.save_failures,
                hb.last_error,
            )
        )
    return rows


def _checkpoints(root: Path, now: float) -> list[CheckpointRow]:
    """Raises OSError when the root cannot be listed."""
    latest = store.read_latest(root)
    rows = []
    for ref in store.list_checkpoints(root):
        v = store.validate(ref)
        if v.gone:
            continue
        m = v.manifest
        age, size = (now - m.wall_time, m.total_bytes) if m is not None else (None, None)
        reason = v.reason.split(": ", 1)[-1] if not v.ok else ""
        rows.append(
            CheckpointRow(ref.name, ref.step, age, size, v.ok, reason, ref.name == latest, v.evidence.value)
        )
    return rows


def _stored(root: Path, now: float) -> tuple[list[CheckpointRow], list[QuarantineRow], str]:
    """Checkpoints and quarantine; what could not be listed is said in one line, never raised."""
    problems = []
    try:
        ckpts = _checkpoints(root, now)
    except OSError as e:
        ckpts = []
        problems.append(f"checkpoints of {root} cannot be listed: {describe(e)}")
    try:
        quarantined = [QuarantineRow(q.name, q.reason) for q in store.list_quarantined(root)]
    except OSError as e:
        quarantined = []
        problems.append(f"{RunDir.of(root).quarantine} cannot be listed: {describe(e)}")
    return ckpts, quarantined, "; ".join(problems)


def _overall(nodes: list[NodeRow], ranks: list[RankRow]) -> tuple[str, str]:
    known = [n for n in nodes if n.status in _SEVERITY]
    if known:
        worst = min(known, key=lambda n: _SEVERITY.index(n.status))
        where = f" (node {worst.node})" if len(nodes) > 1 else ""
        return worst.status, worst.reason + where
    if nodes:
        return UNKNOWN, nodes[0].problem
    if any(not r.stale for r in ranks):
        return events.RUNNING, "ranks are beating; no watchdog state (not started by `supervisor watch`?)"
    return UNKNOWN, "no watchdog state and no live heartbeat"


def _median(xs: list[float]) -> float:
    """Here rather than ``statistics.median``: importing statistics costs `status` 12 ms."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def build_report(root: str | Path, now: float | None = None) -> StatusReport:
    root = store.require_root(root)
    # Heartbeats of this host's boot are aged on the monotonic clock, unless a time is given.
    clock = Clock(time.time(), time.monotonic(), boot_id()) if now is None else Clock(now)
    now = clock.wall
    nodes, launches, tdict, current = _nodes(root)
    try:
        timeouts = PhaseTimeouts.from_dict(tdict)
    except ValueError:
        timeouts = PhaseTimeouts()
    ranks = _ranks(root, clock, timeouts, current)
    state, why = _overall(nodes, ranks)
    live = [r for r in ranks if not r.stale and r.step is not None]
    live_steps = [r.step for r in live if r.step is not None]
    checkpoints, quarantined, storage_problem = _stored(root, now)
    step_times = [r.last_step_s for r in live if r.phase == Phase.TRAIN.value and r.last_step_s]
    return StatusReport(
        root=str(root),
        time=now,
        state=state,
        why=why,
        nodes=tuple(nodes),
        launches=tuple(launches),
        ranks=tuple(ranks),
        current_step=max(live_steps, default=None),
        steps_per_s=1.0 / _median(step_times) if step_times else None,
        checkpoints=tuple(checkpoints),
        in_progress=tuple(sorted(t.path.name for t in store.list_tmp(root, now))),
        quarantined=tuple(quarantined),
        disk_bytes=store.disk_usage(root),
        remote=_remote_status(root),
        storage_problem=storage_problem,
        slurm=_slurm_line(root),
    )


def _slurm_line(root: Path) -> str:
    """The SLURM job's requeue budgets, when sbatch/job.sh ran this run; a file that cannot be
    used is said, not fatal. supervisor.slurm is imported only then, so other runs' status stays fast."""
    if not RunDir.of(root).requeue_state.exists():
        return ""
    from supervisor import slurm

    try:
        st = slurm.read_requeue_state(root)
    except (OSError, ValueError) as e:
        return f"{slurm.requeue_path(root)} cannot be used: {describe(e) if isinstance(e, OSError) else e}"
    if st is None:
        return ""
    last = st.history[-1].get("event", "?") if st.history and isinstance(st.history[-1], dict) else "-"
    return f"job {st.job_id}: {slurm.budget_line(st)}; SLURM restarts {st.restart_count}; last event {last}"


def _remote_status(root: Path) -> RemoteStatus | None:
    """The uploader's status file, when this run has a remote tier; its reader (and tenacity,
    which the uploader needs) is imported only then, so a local-only status stays fast."""
    if not RunDir.of(root).remote_status.exists():
        return None
    from supervisor.tiers.uploader import read_remote_status

    return read_remote_status(root)

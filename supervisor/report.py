"""Run directory -> a frozen report of where the run stands, for a person or a script.

Only reads (no lock, no torch): the watchdogs' state files, heartbeats, checkpoints (quick check:
manifest and file sizes), quarantine, disk use. Its one write: the quick checks that passed, to
list an unchanged checkpoint next time without checking it again (supervisor/store/quickcache.py). A garbage file never stops it; it shows as unknown
with the reason. So does storage that does not answer: a checkpoint that cannot be read is
"unknown" (not invalid), a directory that cannot be listed is named in ``storage_problem``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor import store
from supervisor.format import events
from supervisor.format.atomic import hostname, pid_alive
from supervisor.format.badnodes import read_bad_nodes
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase, boot_id, read_heartbeats
from supervisor.format.layout import RunDir, parse_state_filename, per_node_files, safe_host
from supervisor.format.nodesummary import (
    NodeSummary,
    StragglerNote,
    newest_per_rank,
    read_summary,
    summary_paths,
)
from supervisor.format.roster import read_roster
from supervisor.format.runstatus import RunStatus
from supervisor.store.ioerrors import Evidence, describe
from supervisor.store.quickcache import QuickChecks
from supervisor.watch import oom, rootcause
from supervisor.watch.liveness import (
    Clock,
    PhaseTimeouts,
    describe_progress,
    describe_wait,
    rank_stale,
    silences,
)

if TYPE_CHECKING:
    from supervisor.tiers.uploader import RemoteStatus

UNKNOWN = "unknown"
# Worst first: the run's state is the worst of its nodes' states.
_SEVERITY = (
    RunStatus.FAILED,
    RunStatus.STOPPED,
    RunStatus.REQUEUED,
    RunStatus.RESTARTING,
    RunStatus.RUNNING,
    RunStatus.DONE,
)
# A watchdog in one of these states wrote its last node summary on the way out: old, never stale.
_ENDED = (RunStatus.FAILED, RunStatus.STOPPED, RunStatus.REQUEUED, RunStatus.DONE)
RECENT_LAUNCHES = 10
# Up to this many ranks every rank gets a row; above, the ranks that need a look do (stale,
# unknown, an exit code, failed saves) and the others are counted per node from the summaries'
# headers, so `status` costs the same at 16 or 16,384 ranks (`--all-ranks` lists every one).
FULL_RANKS = 512


# `status --json`'s layout: raised when a field changes meaning or goes away (new fields do not).
# 2: over FULL_RANKS ranks, ``ranks`` lists only those that need a look (``rank_counts`` counts all).
STATUS_SCHEMA = 2


# The rows are plain dataclasses, the report that holds them frozen: `status` builds one per node,
# rank and checkpoint (2,048 + 500 on a big run), and a frozen dataclass's __init__ sets each field
# with object.__setattr__ (4.8 us a NodeRow instead of 0.65 us).
@dataclass
class NodeRow:
    """One watchdog (node) as `status` shows it: its state file, and its node summary's news."""

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
    # From the node's summary (heartbeats/node_NNNNN.json), when its watchdog publishes one.
    summary_age_s: float | None = None
    summary_stale: bool = False  # not rewritten for stale_after_s: watchdog gone or node lost
    ranks: int = 0
    verdict: str = ""  # the last launch's, as the node's watchdog judged it
    culprit: str = ""
    # The last relaunch's recovery, seconds per phase and "total" (supervisor/watch/recovery.py).
    recovery: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RankCounts:
    """Every rank, counted (the rows may list only those that need a look)."""

    total: int = 0
    phases: tuple[tuple[str, int], ...] = ()
    step_min: int | None = None
    step_max: int | None = None
    stale: int = 0  # stale or unknown
    complete: bool = True  # every rank has a row in ``ranks``


@dataclass  # not frozen: see NodeRow
class LaunchRow:
    """One launch of a node's watchdog: how it ended and from which step it resumed."""

    node: int
    number: int
    started: float
    duration_s: float
    outcome: str
    reason: str
    resumed_from: int | None
    last_step: int | None


@dataclass  # not frozen: see NodeRow
class RankRow:
    """One rank as `status` shows it, judged live or stale from its heartbeat."""

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
    exit_code: int | None = None  # set when the rank exited deliberately (its last heartbeat)
    died_of: str = ""  # the exception that ended it (its last heartbeat)
    gone: bool = False  # on this host, its process is gone without an exit code and not done


@dataclass  # not frozen: see NodeRow
class CheckpointRow:
    """One committed checkpoint as `status` lists it, with its quick check's verdict."""

    name: str
    step: int
    age_s: float | None
    size_bytes: int | None
    valid: bool
    reason: str
    latest: bool
    evidence: str = "ok"  # ok, corrupt or unknown (could not be read: not proof of corruption)
    kind: str = ""  # another trainer's (store.ForeignKind: dcp, lightning); "" for this toolkit's
    mark: str = ""  # another trainer's: whether its bytes are proven (sealed) or only its structure


@dataclass(frozen=True)
class QuarantineRow:
    """A checkpoint moved aside, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class StatusReport:
    """Everything `status` says about a run, frozen: rendered for a person or dumped as JSON."""

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
    in_progress: tuple[str, ...]  # checkpoints being written (tmp dirs of live writers)
    quarantined: tuple[QuarantineRow, ...]
    disk_bytes: int
    remote: RemoteStatus | None = None  # the uploader's last word (remote.json); no network call
    storage_problem: str = ""  # the checkpoints or the quarantine could not be listed, and why
    slurm: str = ""  # sbatch/job.sh's requeue budgets (supervisor/slurm.json), one line; "" if none
    retention: str = ""  # the trainer's retention policy (supervisor/retention.json), one line; "" if none
    rank_counts: RankCounts = RankCounts()
    # tmp dirs nobody writes any more, each with why: "step_..tmp.12.vm (writer pid 12 gone)"
    abandoned: tuple[str, ...] = ()
    # The stragglers node 0's watchdog flags now (its node summary), each in words.
    stragglers: tuple[str, ...] = ()
    # With hot spares: the roster's current generation in one line (supervisor/roster.json).
    roster: str = ""
    # The run's bad nodes, one line each with their incidents' evidence, then what was done about
    # them and the other hosts' incidents (supervisor/bad_nodes.json).
    bad_nodes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Shallow per row: ``dataclasses.asdict`` deep-copies and costs 10x on 4096 ranks."""
        d = {"schema": STATUS_SCHEMA, **self.__dict__}
        d["rank_counts"] = dict(self.rank_counts.__dict__, phases=dict(self.rank_counts.phases))
        for key in ("nodes", "launches", "ranks", "checkpoints", "quarantined"):
            d[key] = [row.__dict__ for row in d[key]]
        d["in_progress"] = list(self.in_progress)
        d["abandoned"] = list(self.abandoned)
        d["stragglers"] = list(self.stragglers)
        d["bad_nodes"] = list(self.bad_nodes)
        d["remote"] = dict(self.remote.__dict__, skipped=list(self.remote.skipped)) if self.remote else None
        return d


def _alive(status: str, reason: str, host: str, pid: int, me: str) -> tuple[str, str]:
    """A watchdog on this host whose pid is gone while its state says running has failed."""
    if status in (RunStatus.RUNNING, RunStatus.RESTARTING) and host == me and not pid_alive(pid):
        return RunStatus.FAILED, f"watchdog pid {pid} is gone (its state said: {reason})"
    return status, reason


def _from_summary(s: NodeSummary, me: str, clock: Clock) -> NodeRow:
    """Node N > 0's row from its summary's header alone."""
    h = s.header
    status, reason = _alive(h.status, h.reason, h.host, h.watchdog_pid, me)
    age = clock.age(h)
    return NodeRow(
        h.node,
        h.host,
        h.watchdog_pid,
        status,
        reason,
        h.exit_code,
        h.launch_count,
        h.restarts,
        h.launch_id,
        summary_age_s=age,
        summary_stale=age > h.stale_after_s and status not in _ENDED,
        ranks=h.ranks,
        verdict=h.verdict,
        culprit=h.culprit,
    )


def _state_files(root: Path) -> list[tuple[int, str]]:
    """(node, path) of every watchdog's state file, by node."""
    return per_node_files(os.fspath(RunDir.of(root).supervisor), parse_state_filename)


def _nodes(
    root: Path, summaries: dict[int, NodeSummary], clock: Clock
) -> tuple[list[NodeRow], list[LaunchRow], dict[str, float], set[str]]:
    """Node rows, recent launches, the phase timeouts in force, and the current launch ids. Node
    0's state file is read whole (launches, timeouts); node N > 0's state is taken from its
    summary's header when it has one (2,048 state files with their launch histories would cost
    `status` seconds; every node relaunches together, and each header has its last verdict)."""
    nodes: list[NodeRow] = []
    launches: list[LaunchRow] = []
    timeouts: dict[str, float] = {}
    current: set[str] = set()
    me = hostname()
    for node, path in _state_files(root):
        if node and node in summaries:
            row = _from_summary(summaries[node], me, clock)
            nodes.append(row)
            if row.status == RunStatus.RUNNING:
                current.add(summaries[node].header.launch_id)
            continue
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
        status, reason = _alive(st.status, st.reason, st.host, st.watchdog_pid, me)
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
        if status == RunStatus.RUNNING:
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


def _row(
    snap: HeartbeatSnapshot,
    clock: Clock,
    timeouts: PhaseTimeouts,
    current: set[str],
    lost: str,
    me: str,
    silent: dict[int, float],
) -> RankRow:
    """One rank's row; ``lost`` says its node's summary is stale (its news may be old); a rank
    of this host (``me``) whose process is gone without an exit code is ``gone``; its silence
    (``silences``: since progress, not since the last beat) is ``silent[id(heartbeat)]``."""
    hb = snap.heartbeat
    if hb is None:
        return RankRow(snap.rank, "", None, None, UNKNOWN, None, None, True, snap.problem)
    age = clock.age(hb)
    stale, note = rank_stale(hb, silent.get(id(hb), age), timeouts.for_beat(hb), current)
    if waiting := describe_wait(hb, clock.wall):
        note = (note + "; " if note else "") + waiting
    if lost and hb.phase != Phase.DONE:
        stale, note = True, lost
    gone = hb.host == me and hb.phase != Phase.DONE and hb.exit_code is None and not pid_alive(hb.pid)
    if hb.died_of:
        note = (note + "; " if note else "") + f"died of {hb.died_of}"
    elif gone:
        note = (note + "; " if note else "") + f"pid {hb.pid} gone without an exit code"
    if hb.exit_code is not None:
        note = (note + "; " if note else "") + f"exit code {hb.exit_code}"
    if hb.save_failures:
        note = (note + "; " if note else "") + f"{hb.save_failures} failed saves: {hb.last_error}"
    progress = (
        ""
        if hb.phase in (Phase.TRAIN, Phase.DONE)
        else describe_progress(hb.progress, hb.progress_total, hb.io_path)
    )
    return RankRow(
        hb.rank,
        hb.host,
        hb.pid,
        hb.step,
        hb.label,
        age,
        hb.last_step_s,
        stale,
        note,
        progress,
        hb.save_failures,
        hb.last_error,
        hb.exit_code,
        hb.died_of,
        gone,
    )


@dataclass
class _RankView:
    """What the heartbeats say: rows, counts, and the live steps and step times of the ranks;
    ``failed``: the last beats of the ranks that failed (died of an exception, or gone)."""

    rows: list[RankRow]
    counts: RankCounts
    live_steps: list[int]
    step_times: list[float]
    summaries: dict[int, NodeSummary]
    summary_problems: dict[int, str]
    failed: list[Heartbeat] = field(default_factory=list)


def _summaries(root: Path) -> tuple[dict[int, NodeSummary], dict[int, str]]:
    """Every node summary's header (records unparsed), and the ones that cannot be used, why."""
    ok: dict[int, NodeSummary] = {}
    bad: dict[int, str] = {}
    for node, path in summary_paths(root):
        try:
            ok[node] = read_summary(path)
        except OSError as e:
            bad[node] = f"{path}: {describe(e)}"
        except ValueError as e:
            bad[node] = f"{path}: {e}"
    return ok, bad


def stale_note(s: NodeSummary, age: float) -> str:
    h = s.header
    return (
        f"node {h.node} summary {age:.0f}s old (stale after {h.stale_after_s:g}s): "
        "its watchdog is gone or the node is lost"
    )


def _ranks(
    root: Path,
    clock: Clock,
    timeouts: PhaseTimeouts,
    current: set[str],
    all_ranks: bool,
    ended: set[int],
    read: tuple[dict[int, NodeSummary], dict[int, str]],
) -> _RankView:
    """Ranks from the node summaries and any rank files in the run directory (ranks without a
    watchdog). Up to FULL_RANKS (or ``all_ranks``) every rank gets a row; above, only the ranks
    the watchdogs flagged and every rank of a stale node do, the rest are counted from headers.
    A summary is stale when not rewritten for its stale_after_s while its watchdog's state does
    not say it ended (``ended``: those nodes wrote their last summary on the way out)."""
    summaries, bad = read
    snaps = list(read_heartbeats(root))
    total = len(snaps) + sum(s.header.ranks for s in summaries.values())
    complete = all_ranks or total <= FULL_RANKS
    lost: dict[str, str] = {}  # summary path -> why its ranks' news may be old
    counted: list[NodeSummary] = []  # fresh nodes counted from their header
    for node, s in summaries.items():
        age = clock.age(s.header)
        if age > s.header.stale_after_s and node not in ended:
            lost[s.path] = stale_note(s, age)
        keep = None  # every rank of the node, or only those it flagged
        if age <= s.header.stale_after_s and not complete:
            counted.append(s)
            if not s.header.attention:
                continue
            keep = set(s.header.attention)
        try:
            node_snaps = s.snapshots()
        except ValueError as e:
            bad[node] = f"{s.path}: {e}"
            continue
        snaps += [x for x in node_snaps if keep is None or x.rank in keep]
    me = hostname()
    newest = newest_per_rank(snaps)
    beats = [x.heartbeat for x in newest if x.heartbeat is not None]
    silent = dict(zip(map(id, beats), silences(beats, clock), strict=True))
    rows = [_row(x, clock, timeouts, current, lost.get(x.path, ""), me, silent) for x in newest]
    failed = [x.heartbeat for x, r in zip(newest, rows, strict=True) if x.heartbeat and (r.died_of or r.gone)]
    return _RankView(rows, *_tally(rows, counted, complete), summaries, bad, failed)


def _tally(
    rows: list[RankRow], counted: list[NodeSummary], complete: bool
) -> tuple[RankCounts, list[int], list[float]]:
    """Counts over the rows and the counted nodes (whose flagged ranks are among the rows)."""
    listed = {r.rank: r for r in rows}
    phases: dict[str, int] = {}
    for r in rows:
        phases[r.phase] = phases.get(r.phase, 0) + 1
    steps = [r.step for r in rows if r.step is not None]
    live = [r for r in rows if not r.stale and r.step is not None]
    live_steps = [r.step for r in live if r.step is not None]
    step_times = [r.last_step_s for r in live if r.phase == Phase.TRAIN.value and r.last_step_s]
    total = len(rows)
    for s in counted:
        h = s.header
        flagged = [listed[a] for a in h.attention if a in listed]
        total += h.ranks - len(flagged)
        for phase, n in h.phases.items():
            phases[phase] = phases.get(phase, 0) + n - sum(1 for r in flagged if r.phase == phase)
        steps += [x for x in (h.step_min, h.step_max) if x is not None]
        live_steps += [h.live_step_max] if h.live_step_max is not None else []
        step_times += [h.last_step_s] if h.last_step_s else []
    counts = RankCounts(
        total=total,
        phases=tuple(sorted((p, n) for p, n in phases.items() if n > 0)),
        step_min=min(steps, default=None),
        step_max=max(steps, default=None),
        stale=sum(1 for r in rows if r.stale),
        complete=complete,
    )
    return counts, live_steps, step_times


def _ended(nodes: list[NodeRow]) -> set[int]:
    """Nodes whose watchdog's state says it is neither running nor about to relaunch."""
    return {n.node for n in nodes if n.status in _ENDED}


def _with_summaries(nodes: list[NodeRow], view: _RankView, clock: Clock) -> list[NodeRow]:
    """Each watchdog's row read from a state file, with what its node summary says (age, stale,
    verdict, culprit)."""
    out = []
    for n in nodes:
        s = view.summaries.get(n.node)
        if s is not None and n.summary_age_s is None:
            age = clock.age(s.header)
            n = replace(
                n,
                summary_age_s=age,
                summary_stale=age > s.header.stale_after_s and n.status not in _ENDED,
                ranks=s.header.ranks,
                verdict=s.header.verdict,
                culprit=s.header.culprit,
            )
        elif n.node in view.summary_problems:
            n = replace(n, problem=n.problem or f"node summary unusable: {view.summary_problems[n.node]}")
        out.append(n)
    return out


def _checkpoints(root: Path, now: float, disk: dict[str, int]) -> list[CheckpointRow]:
    """Raises OSError when the root cannot be listed. Quick checks that passed before on the same
    files are remembered (supervisor/store/quickcache.py); ``disk`` gets the bytes under each checkpoint
    walked whole, by path, so the disk use need not walk them again."""
    latest = store.read_latest(root)
    cache = QuickChecks(root)
    rows = []
    for ref in store.list_checkpoints(root):
        c = cache.check(ref)
        if c.disk_bytes is not None:
            disk[os.fspath(ref.path)] = c.disk_bytes
        if c.gone:
            continue
        age = now - c.wall_time if c.wall_time is not None else None
        ok = c.evidence is Evidence.OK
        reason = c.reason.split(": ", 1)[-1] if not ok else ""
        rows.append(
            CheckpointRow(
                ref.name, ref.step, age, c.total_bytes, ok, reason, ref.name == latest, c.evidence.value
            )
        )
    cache.save()
    return rows


def _foreign(root: Path, now: float) -> list[CheckpointRow]:
    """Other trainers' checkpoints (torchtitan's step-N/, Lightning's .ckpt), quick structural check."""
    rows = []
    for ref in store.list_foreign(root):
        fv = store.validate_foreign(ref)
        v = fv.verdict
        if v.gone:
            continue
        age = now - fv.size.wall_time if fv.size.wall_time else None
        reason = v.reason.split(": ", 1)[-1] if not v.ok else ""
        rows.append(
            CheckpointRow(
                ref.name, ref.step, age, fv.size.bytes, v.ok, reason, False, v.evidence.value,
                kind=ref.kind.value, mark=fv.mark,
            )
        )  # fmt: skip
    return rows


def _stored(
    root: Path, now: float, disk: dict[str, int]
) -> tuple[list[CheckpointRow], list[QuarantineRow], str, int]:
    """Checkpoints, quarantine and the disk use (``disk``: bytes of the files already read, by
    path); what could not be listed is said in one line, never raised."""
    problems = []
    try:
        ckpts = _checkpoints(root, now, disk)
    except OSError as e:
        ckpts = []
        problems.append(f"checkpoints of {root} cannot be listed: {describe(e)}")
    try:
        ckpts += _foreign(root, now)
    except OSError as e:
        problems.append(f"other trainers' checkpoints in {root} cannot be listed: {describe(e)}")
    try:
        quarantined = [QuarantineRow(q.name, q.reason) for q in store.list_quarantined(root)]
    except OSError as e:
        quarantined = []
        problems.append(f"{RunDir.of(root).quarantine} cannot be listed: {describe(e)}")
    return ckpts, quarantined, "; ".join(problems), store.disk_usage(root, disk)


def _overall(nodes: list[NodeRow], view: _RankView) -> tuple[str, str]:
    known = [n for n in nodes if n.status in _SEVERITY]
    if known:
        worst = min(known, key=lambda n: _SEVERITY.index(n.status))
        where = f" (node {worst.node})" if len(nodes) > 1 else ""
        lost = [n.node for n in nodes if n.summary_stale]
        if lost:
            where += f"; STALE node summary of node {', '.join(map(str, lost))}: watchdog gone or node lost?"
        return worst.status, worst.reason + where
    if nodes:
        return UNKNOWN, nodes[0].problem
    return _without_watchdog(view)


_NO_WATCHDOG = "no watchdog state (not started by `supervisor watch`?)"


def _without_watchdog(view: _RankView) -> tuple[str, str]:
    """The run's state from its heartbeats alone (plain torchrun): done when every rank's last
    beat says so; failed when a rank died of an exception or, on this host, is gone without an
    exit code (the first to fail named, by time, the others as its consequences: the same rule
    as the watchdog's root cause, without torchelastic's error files, which torchrun keeps in a
    temporary folder); running while ranks beat."""
    c = view.counts
    if c.total and dict(c.phases).get(Phase.DONE.value, 0) == c.total:
        return RunStatus.DONE, f"every rank finished; {_NO_WATCHDOG}"
    if view.failed:
        gone = {hb.rank for hb in view.failed}
        ends = rootcause.rank_ends(view.failed, gone, killed=_killed_here)
        return RunStatus.FAILED, f"root cause {rootcause.describe_ends(ends)}; {_NO_WATCHDOG}"
    if c.total > c.stale:
        return RunStatus.RUNNING, f"ranks are beating; {_NO_WATCHDOG}"
    return UNKNOWN, "no watchdog state and no live heartbeat"


def _killed_here(hb: Heartbeat) -> str:
    """A rank of this host gone without an exception: the OOM killer when the kernel's log names it."""
    return oom.killed_note(hb.pid, oom.kernel_kill_line(hb.pid), None, None) or rootcause.KILLED


@dataclass(frozen=True)
class LiveSign:
    """Something that says a run is using its run directory now."""

    what: str  # one line naming the watchdog or rank, its host and pid
    here: bool  # on this host, its pid alive: proof; else only its own word, not checkable from here


def live_signs(root: str | Path) -> list[LiveSign]:
    """Watchdogs whose state says running or restarting, and ranks whose heartbeat is fresh
    (within its phase's timeout), not done and not exited; on this host only those whose pid is
    alive. What mutating commands (`ckpt rollback`) refuse to run beside."""
    report = build_report(root, all_ranks=True)
    me = hostname()
    signs = [
        LiveSign(f"watchdog pid {n.watchdog_pid} on {n.host} is {n.status}", n.host == me)
        for n in report.nodes
        if n.status in (RunStatus.RUNNING, RunStatus.RESTARTING)
    ]
    for r in report.ranks:
        if r.stale or r.phase in (Phase.DONE.value, UNKNOWN) or r.exit_code is not None:
            continue
        if r.host != me or (r.pid is not None and pid_alive(r.pid)):
            age = "-" if r.age_s is None else f"{r.age_s:.0f}s"
            signs.append(
                LiveSign(f"rank {r.rank} (pid {r.pid} on {r.host}) beat {age} ago, {r.phase}", r.host == me)
            )
    return signs


def _median(xs: list[float]) -> float:
    """Here rather than ``statistics.median``: importing statistics costs `status` 12 ms."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def build_report(root: str | Path, now: float | None = None, all_ranks: bool = False) -> StatusReport:
    root = store.require_root(root)
    # Heartbeats of this host's boot are aged on the monotonic clock, unless a time is given.
    clock = Clock(time.time(), time.monotonic(), boot_id()) if now is None else Clock(now)
    now = clock.wall
    summaries = _summaries(root)
    nodes, launches, tdict, current = _nodes(root, summaries[0], clock)
    try:
        timeouts = PhaseTimeouts.from_dict(tdict)
    except ValueError:
        timeouts = PhaseTimeouts()
    view = _ranks(root, clock, timeouts, current, all_ranks, _ended(nodes), summaries)
    nodes = _with_summaries(nodes, view, clock)
    state, why = _overall(nodes, view)
    live_steps, step_times = view.live_steps, view.step_times
    read = {s.path: s.size for s in view.summaries.values()}
    checkpoints, quarantined, storage_problem, disk_bytes = _stored(root, now, read)
    tmps, me = store.list_tmp(root, now), hostname()
    dead = [t for t in tmps if store.tmp_is_stale(t, me, pid_alive, store.STALE_TMP_AFTER_S)]
    return StatusReport(
        root=str(root),
        time=now,
        state=state,
        why=why,
        nodes=tuple(nodes),
        launches=tuple(launches),
        ranks=tuple(view.rows),
        current_step=max(live_steps, default=None),
        steps_per_s=1.0 / _median(step_times) if step_times else None,
        checkpoints=tuple(checkpoints),
        in_progress=tuple(sorted(t.path.name for t in tmps if t not in dead)),
        abandoned=tuple(sorted(_abandoned(t) for t in dead)),
        quarantined=tuple(quarantined),
        disk_bytes=disk_bytes,
        remote=_remote_status(root),
        storage_problem=storage_problem,
        slurm=_slurm_line(root),
        retention=_retention_line(root),
        rank_counts=view.counts,
        stragglers=tuple(
            n.text or f"rank {n.rank} on {n.host}: {n.kind} {n.value:.2f}" for n in _stragglers(view)
        ),
        roster=_roster_line(root),
        bad_nodes=_bad_node_lines(root),
    )


def _stragglers(view: _RankView) -> list[StragglerNote]:
    """The judge's flags: the first node summary that has some (node 0's: it judges)."""
    for _, s in sorted(view.summaries.items()):
        if s.header.stragglers:
            return list(s.header.stragglers)
    return []


def _roster_line(root: Path) -> str:
    if not RunDir.of(root).roster.exists():
        return ""
    try:
        r = read_roster(root)
    except (OSError, ValueError) as e:
        return f"{RunDir.of(root).roster} cannot be used: {describe(e) if isinstance(e, OSError) else e}"
    if r is None:
        return ""
    if r.stop:
        return f"job {r.key}: stopped at generation {r.generation} (exit {r.exit_code}): {r.reason}"
    swapped = "; ".join(f"{a} replaced by {b}" for a, b in r.replaced.items())
    return f"job {r.key}: {r.describe()}" + (f"; {swapped}" if swapped else "") + f" ({r.reason})"


def _bad_node_lines(root: Path) -> tuple[str, ...]:
    if not RunDir.of(root).bad_nodes.exists():
        return ()
    try:
        bad = read_bad_nodes(root)
    except (OSError, ValueError) as e:
        return (
            f"{RunDir.of(root).bad_nodes} cannot be used: {describe(e) if isinstance(e, OSError) else e}",
        )
    if bad is None:
        return ()
    lines = [
        f"BAD {host}: {len(its)} incidents (threshold {bad.threshold}): "
        + " | ".join(i.describe() for i in its)
        for host, its in bad.bad.items()
    ]
    others: dict[str, int] = {}
    for i in bad.incidents:
        if i.host not in bad.bad:
            others[i.host] = others.get(i.host, 0) + 1
    if others:
        lines.append(
            f"incidents below the threshold ({bad.threshold}): "
            + ", ".join(f"{h} {n}" for h, n in sorted(others.items()))
        )
    lines += [f"{a.what} {', '.join(a.hosts)} (job {a.job}): {a.detail}" for a in bad.actions[-3:]]
    return tuple(lines)


def _abandoned(t: store.TmpRef) -> str:
    """A tmp dir nobody writes any more, and how that is known: its writer's pid is gone (this
    host), or nothing in it changed for an hour (another host's: its pid cannot be checked)."""
    if t.host == safe_host(hostname()):
        return f"{t.path.name} (writer pid {t.pid} gone)"
    return f"{t.path.name} (nothing written for {t.age_s / 3600:.1f} h by pid {t.pid} on {t.host})"


def _retention_line(root: Path) -> str:
    """The retention policy the trainer recorded; a record that cannot be used is said, not fatal."""
    try:
        policy = store.read_policy(root)
    except store.StoreError as e:
        return str(e)
    except OSError as e:
        return f"{RunDir.of(root).retention}: {describe(e)}"
    return "" if policy is None else f"keeps {policy.describe()}"


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

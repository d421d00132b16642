"""Pure detectors over a launch's heartbeats: hung ranks, ranks dead without an exit code, and
changes in the save failures ranks report. Time is passed in; the loop in ``loop.py`` reads the
heartbeats and acts on what these find."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from supervisor.format import eventtypes as ev
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase
from supervisor.watch.liveness import Clock, PhaseTimeouts, describe_progress, describe_wait, silences


@dataclass(frozen=True)
class Hang:
    rank: int | None  # None: the launch as a whole (no heartbeat at all yet)
    pid: int | None
    phase: Phase
    step: int
    silent_s: float
    timeout_s: float
    progress: int = 0
    progress_total: int = 0
    io_path: str = ""  # the file the heartbeat says it was reading or writing
    blocked: str = ""  # what /proc says it is blocked in (launcher.blocked_io), filled in by watch
    phase_name: str = ""  # a custom phase's own name (eval...)
    waiting: str = ""  # what it said it waits for, beating without progress (describe_wait)

    @property
    def label(self) -> str:
        return self.phase_name or self.phase.value

    @property
    def reason(self) -> str:
        who = "no rank" if self.rank is None else f"rank {self.rank}"
        where = describe_progress(self.progress, self.progress_total, self.io_path)
        return (
            f"{who} made no progress for {self.silent_s:.1f}s in phase {self.label} at step "
            f"{self.step} (timeout {self.timeout_s:g}s{'; ' + where if where else ''})"
            + (f"; {self.waiting}, beating without progress" if self.waiting else "")
            + (f"; blocked in {self.blocked}" if self.blocked else "")
        )


def launch_heartbeats(snapshots: Iterable[HeartbeatSnapshot], launch_id: str) -> list[Heartbeat]:
    """Heartbeats written during this launch; older ones are stale and say nothing about it."""
    return [s.heartbeat for s in snapshots if s.heartbeat is not None and s.heartbeat.launch_id == launch_id]


def detect_hangs(
    snapshots: Sequence[HeartbeatSnapshot],
    *,
    launch_id: str,
    launch_age_s: float,
    clock: Clock,
    timeouts: PhaseTimeouts,
    require_heartbeat: bool = False,
) -> list[Hang]:
    """Ranks of this launch without progress for longer than their phase allows (``silences``:
    beats that advance nothing do not count, so a wait that beats is no progress; a long phase that
    progresses is never a hang). Ranks silent while they wait are named only when no rank that
    waits for nothing is (then they wait for each other). Before any rank of this launch has
    beaten, the launch is judged on its exit code alone (a command that writes no heartbeat cannot
    earn a hang verdict), unless ``require_heartbeat``: then it is hung once older than the
    startup timeout (a rendezvous or ``init_process_group`` that never returns); ``launch_age_s``
    is on the monotonic clock."""
    beats = launch_heartbeats(snapshots, launch_id)
    if not beats:
        if require_heartbeat and launch_age_s > timeouts.startup:
            return [Hang(None, None, Phase.STARTUP, 0, launch_age_s, timeouts.startup)]
        return []
    hangs = []
    for hb, silent in zip(beats, silences(beats, clock), strict=True):
        limit = timeouts.for_beat(hb)
        if limit is not None and silent > limit:
            hangs.append(
                Hang(
                    hb.rank,
                    hb.pid,
                    hb.phase,
                    hb.step,
                    silent,
                    limit,
                    hb.progress,
                    hb.progress_total,
                    hb.io_path,
                    phase_name=hb.phase_name if hb.phase is Phase.CUSTOM else "",
                    waiting=describe_wait(hb, clock.wall),
                )
            )
    stuck = [h for h in hangs if not h.waiting]
    return stuck or hangs  # those who wait for a stuck rank are not named beside it


def gave_up(beats: Sequence[Heartbeat], clock: Clock, timeouts: PhaseTimeouts) -> tuple[list[Hang], str]:
    """A rank that gave up waiting for its peers in a save's exchange (exit 76: its waits are
    bounded at half the save/commit timeout) makes the launch hung now, before any phase timeout:
    the hang names the ranks it waited for, those still running that wait for nobody (stuck in a
    file, or elsewhere), else every rank still running, each with its silence; with what the ranks
    that gave up said (for the event's message). Nothing when no rank gave up."""
    quit_ = [b for b in beats if b.exit_code == Exit.WAIT_GAVE_UP]
    if not quit_:
        return [], ""
    note = "; ".join(
        f"rank {b.rank} gave up waiting for {b.waiting or 'its peers'} at step {b.step}" for b in quit_
    )
    running = [
        (b, s)
        for b, s in zip(beats, silences(beats, clock), strict=True)
        if b.exit_code is None and b.phase != Phase.DONE
    ]
    suspects = [(b, s) for b, s in running if not b.waiting] or running
    hangs = [
        Hang(
            b.rank, b.pid, b.phase, b.step, s, timeouts.for_beat(b) or 0.0, b.progress, b.progress_total, b.io_path,
            phase_name=b.phase_name if b.phase is Phase.CUSTOM else "", waiting=describe_wait(b, clock.wall),
        )
        for b, s in suspects
    ]  # fmt: skip
    if not hangs:  # nobody left to blame: the ranks that gave up stand for the launch
        hangs = [
            Hang(
                b.rank,
                b.pid,
                b.phase,
                b.step,
                clock.silence(b),
                timeouts.for_beat(b) or 0.0,
                waiting=b.waiting,
            )
            for b in quit_
        ]
    return hangs, note


def hang_due_s(beats: Sequence[Heartbeat], clock: Clock, timeouts: PhaseTimeouts) -> float | None:
    """Seconds until ``detect_hangs`` would first find one of these ranks hung if none advanced
    again; None if it never would. The watchdog checks again then rather than a poll interval
    later, so a silent rank is judged at its timeout, not up to ``--poll-interval`` after it. (A
    launch with no heartbeat yet keeps the poll interval: the startup timeout is minutes.)"""
    due = [
        limit - silent
        for hb, silent in zip(beats, silences(beats, clock), strict=True)
        if (limit := timeouts.for_beat(hb)) is not None
    ]
    return min(due, default=None)


@dataclass(frozen=True)
class DeadRank:
    rank: int
    pid: int
    step: int

    @property
    def reason(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) died at step {self.step} without an exit code"


def dead_ranks(beats: Iterable[Heartbeat], host: str, live_pids: Collection[int]) -> list[DeadRank]:
    """Ranks of this launch on ``host`` whose process is gone without recording an exit code:
    a crash, or a clean exit whose last heartbeat could not be written (a full disk); see
    ``confirm_dead``. Seeing it here, rather than waiting for torchrun to notice and then wait out
    its own shutdown of the surviving ranks (up to 30 s), is what makes a restart start at once."""
    return [
        DeadRank(b.rank, b.pid, b.step)
        for b in beats
        if b.host == host and b.exit_code is None and b.phase != Phase.DONE and b.pid not in live_pids
    ]


def confirm_dead(
    gone: Sequence[DeadRank],
    first_seen: Mapping[int, float],
    now: float,
    *,
    survivors: bool,
    grace_s: float,
    all_gone_wait_s: float,
    failed: Collection[int] = (),
) -> tuple[list[DeadRank], dict[int, float]]:
    """Which of the ranks seen ``gone`` are dead, and when each was first seen gone (keep it for
    the next call; ``now`` monotonic). A rank that exited 0 without its final heartbeat is not a
    death: its launched command will exit 0. So a vanished rank counts as dead only once no rank
    has vanished for ``grace_s`` while others still run (they wait for it in a collective:
    killing them at once is what keeps a restart fast); when no local rank is left, nobody needs
    rescuing, and the launched command's exit code is waited for up to ``all_gone_wait_s``. A
    vanished rank in ``failed`` (it recorded the exception that ended it: torchelastic's error
    file) was no clean exit: the launch is dead at once. The dead are listed first-vanished
    first: the others may have died of it."""
    seen = {d.rank: first_seen.get(d.rank, now) for d in gone}
    if not gone:
        return [], seen
    quiet = now - max(seen.values())
    first = sorted(gone, key=lambda d: (seen[d.rank], d.rank))  # the first to vanish: the likely cause
    if any(d.rank in failed for d in gone):
        return first, seen
    return (first if quiet >= (grace_s if survivors else all_gone_wait_s) else []), seen


@dataclass(frozen=True)
class SaveNews:
    """A change in the save failures ranks report: ``failures`` > 0 failed, 0 recovered; ``step``
    is the heartbeat's when the change was seen (the save's own step is in ``last_error``)."""

    ranks: tuple[int, ...]
    step: int
    failures: int
    last_error: str

    @property
    def event(self) -> ev.SaveFailed | ev.SaveRecovered:
        kind = ev.SaveFailed if self.failures else ev.SaveRecovered
        return kind(
            rank=self.ranks[0],
            ranks=list(self.ranks),
            step=self.step,
            save_failures=self.failures,
            last_error=self.last_error,
        )

    @property
    def msg(self) -> str:
        who = f"rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}"
        if self.failures:
            return (
                f"{who}: a save failed ({self.failures} in a row, reported at step {self.step}): "
                f"{self.last_error}; training goes on, the last committed checkpoint stands"
            )
        return f"{who}: saves work again (reported at step {self.step})"


def save_news(beats: Iterable[Heartbeat], seen: Mapping[int, int]) -> tuple[list[SaveNews], dict[int, int]]:
    """News since ``seen`` (rank -> save_failures last reported): ranks whose count rose, and
    ranks back at 0, grouped by what they say (every rank reports the same agreed failure)."""
    groups: dict[tuple[int, int, str], list[int]] = {}
    now = dict(seen)
    for b in beats:
        before = seen.get(b.rank, 0)
        if b.save_failures != before:
            now[b.rank] = b.save_failures
            if b.save_failures > before or b.save_failures == 0:
                err = b.last_error if b.save_failures else ""
                groups.setdefault((b.step, b.save_failures, err), []).append(b.rank)
    news = [SaveNews(tuple(sorted(r)), step, n, err) for (step, n, err), r in sorted(groups.items())]
    return news, now

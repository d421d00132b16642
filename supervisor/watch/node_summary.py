"""Node-local heartbeats: the folder a node's ranks write into, and the summary its watchdog
publishes from it into the shared run directory (supervisor.format.nodesummary).

Thousands of ranks each rewriting a file in one shared directory every second are thousands of
metadata operations a second on the shared filesystem; here the ranks write into memory on
their node and the shared filesystem sees one write per node per ``--summary-interval``.
Deciding what a summary says is pure (``build_summary``, ``rank_stale``); the ``Publisher``
thread only reads the folder and writes the file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from supervisor.format import events
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase, boot_id, read_heartbeat_folder
from supervisor.format.layout import RunDir, job_key, node_heartbeat_dir
from supervisor.format.nodesummary import (
    RankProblem,
    StragglerNote,
    SummaryHeader,
    stale_after,
    write_summary,
)
from supervisor.store.ioerrors import describe
from supervisor.watch.liveness import Clock, PhaseTimeouts, rank_stale, silences

# At exit, how long to wait for the publisher thread (a write blocked on a hung shared
# filesystem) before giving up on the final summary.
STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class NodeFacts:
    """Who publishes, and what the watchdog knows beyond the ranks' files."""

    node: int
    host: str
    watchdog_pid: int
    interval_s: float
    status: str = ""  # the watchdog's state (events.RunState), kept current by the loop
    reason: str = ""
    exit_code: int | None = None
    launch_count: int = 0
    restarts: int = 0
    launch_id: str = ""  # the launch running now ('' between launches)
    verdict: str = ""
    culprit: str = ""
    role: str = ""  # under a roster (--roster): nodesummary.ROLE_*
    roster_gen: int = 0
    roster_wait: int = 0
    stragglers: tuple[StragglerNote, ...] = ()  # this watchdog's straggler verdicts (the judge's)


def build_summary(
    snaps: Iterable[HeartbeatSnapshot], facts: NodeFacts, clock: Clock, timeouts: PhaseTimeouts
) -> tuple[SummaryHeader, list[dict[str, Any]], list[RankProblem]]:
    """The header, the records (each as its rank wrote it) and the unreadable rank files."""
    records: list[dict[str, Any]] = []
    problems: list[RankProblem] = []
    attention: list[int] = []
    fine: list[Heartbeat] = []
    phases: dict[str, int] = {}
    steps: list[int] = []
    current = {facts.launch_id} if facts.launch_id else set()
    snaps = list(snaps)
    known = [s.heartbeat for s in snaps if s.heartbeat is not None and s.record is not None]
    silent = dict(zip(map(id, known), silences(known, clock), strict=True))
    for s in snaps:
        hb = s.heartbeat
        if hb is None or s.record is None:
            problems.append(RankProblem(s.rank, s.path, s.problem))
            attention.append(s.rank)
            continue
        records.append(s.record)
        phases[hb.label] = phases.get(hb.label, 0) + 1
        steps.append(hb.step)
        stale, _ = rank_stale(hb, silent[id(hb)], timeouts.for_beat(hb), current)
        if stale or hb.exit_code is not None or hb.save_failures or hb.died_of:
            attention.append(hb.rank)
        else:
            fine.append(hb)
    step_times = sorted(b.last_step_s for b in fine if b.phase == Phase.TRAIN and b.last_step_s > 0)
    header = SummaryHeader(
        node=facts.node,
        host=facts.host,
        watchdog_pid=facts.watchdog_pid,
        wall_time=clock.wall,
        interval_s=facts.interval_s,
        stale_after_s=stale_after(facts.interval_s),
        mono_time=clock.mono,
        boot_id=clock.boot_id,
        status=facts.status,
        reason=facts.reason,
        exit_code=facts.exit_code,
        launch_count=facts.launch_count,
        restarts=facts.restarts,
        launch_id=facts.launch_id,
        verdict=facts.verdict,
        culprit=facts.culprit,
        ranks=len(records) + len(problems),
        phases=phases,
        step_min=min(steps, default=None),
        step_max=max(steps, default=None),
        live_step_max=max((b.step for b in fine), default=None),
        last_step_s=step_times[len(step_times) // 2] if step_times else None,
        attention=tuple(sorted(attention)),
        role=facts.role,
        roster_gen=facts.roster_gen,
        roster_wait=facts.roster_wait,
        stragglers=facts.stragglers,
    )
    return header, records, problems


def prepare_folder(base: Path, root: Path, node: int) -> Path:
    """Create this node's folder for the run (layout.node_heartbeat_dir); the user's top folder is
    private (0700) and must be this user's own real directory, since /dev/shm is shared by every
    user of the node. Raises OSError (with the reason) when it cannot be used."""
    folder = node_heartbeat_dir(base, root, node, job_key())
    user = folder.parent.parent
    with contextlib.suppress(FileExistsError):
        user.mkdir(mode=0o700, parents=True)
    st = os.lstat(user)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{user} is not a directory of this user (uid {os.getuid()})")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def choose_folder(base: Path, root: Path, node: int) -> tuple[Path, str]:
    """The folder the node's ranks write into and a sentence for the event log: the node-local
    one, or, when it cannot be made, the run directory's heartbeats/ (slower on a shared
    filesystem, still correct) with the reason."""
    try:
        folder = prepare_folder(base, root, node)
    except OSError as e:
        run = RunDir.of(root).heartbeats
        why = describe(e) if e.errno else str(e)
        return run, f"node-local heartbeat folder under {base} unusable ({why}): ranks write into {run}"
    return (
        folder,
        f"ranks write their heartbeats into {folder}; node summary {RunDir.of(root).node_summary(node)}",
    )


class Publisher:
    """Publishes the node summary every interval from a thread of its own: a long pick, a backoff
    or a blocked write to the shared filesystem never holds up the watchdog's loop, and the
    summary stays fresh exactly as long as the watchdog lives. A failed write is said once on
    stderr per streak and tried again at the next interval."""

    def __init__(self, root: Path, folder: Path, facts: NodeFacts, timeouts: PhaseTimeouts) -> None:
        self.root, self.folder, self.facts, self.timeouts = root, folder, facts, timeouts
        self.error = ""  # why the last write failed ('' when it worked)
        self._stop = threading.Event()
        self._wake = threading.Event()  # write now, not at the next interval (``poke``)
        self._thread = threading.Thread(target=self._run, name="node-summary", daemon=True)

    def update(self, **changes: object) -> None:
        """A new launch id, verdict, culprit or straggler verdicts: in the next summary (one write
        per interval)."""
        self.facts = replace(self.facts, **changes)  # type: ignore[arg-type]

    def poke(self) -> None:
        """Write the summary now: news another node waits for (a roster's readiness)."""
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.publish()
            self._wake.wait(self.facts.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return

    def publish(self) -> bool:
        snaps = read_heartbeat_folder(self.folder)
        clock = Clock(time.time(), time.monotonic(), boot_id())
        header, records, problems = build_summary(snaps, self.facts, clock, self.timeouts)
        try:
            write_summary(self.root, header, records, problems)
        except OSError as e:
            if not self.error:
                path = RunDir.of(self.root).node_summary(self.facts.node)
                events.say(
                    f"[supervisor] node summary {path} not written ({describe(e)}); retrying every {self.facts.interval_s:g}s"
                )
            self.error = describe(e)
            return False
        if self.error:
            events.say(f"[supervisor] node summary written again (it failed with {self.error})")
            self.error = ""
        return True

    def stop(self) -> None:
        """The last summary (the final verdict and heartbeats), then the node-local folder is
        removed: it is memory, and everything in it is in the summary. Kept when that last
        summary could not be written, or the thread is stuck in a write."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive() or not self.publish():
            return
        remove_folder(self.folder)


def remove_folder(folder: Path) -> None:
    """The node's heartbeat files and the folder, and its job's folder once empty; best effort."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):
                os.unlink(folder / name)
        folder.rmdir()
        folder.parent.rmdir()

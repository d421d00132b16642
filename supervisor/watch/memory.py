"""The watchdog's side of the memory tier (docs/tiers.md#the-memory-tier): it owns the node-local
folder the ranks snapshot into (made fresh at start, handed to every launch, removed at the end;
locked for as long as the watchdog lives, so a later watchdog removes it if this one dies first:
memory_owner.py),
and before a relaunch it picks the snapshot the launch resumes from.

The pick: the newest snapshot every local rank finished (``memsnap.complete``) that is not older
than the newest checkpoint on disk, each rank's data checked against its index's checksum here,
before the launch (a snapshot that fails is skipped for the one in the other slot, with the reason
in the event log); its choice goes to ``pick.json`` for that launch's ranks, who check their own
part again before copying a byte. None usable: the reason in the events, the folder's snapshots
forgotten (the run goes on from the disk, and a snapshot of the future it abandons must never be
picked later), and the disk tier's pick.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format import memsnap
from supervisor.format.events import EventLog
from supervisor.format.layout import MEMORY_DIR_ENV, job_key, node_memory_dir
from supervisor.store.ioerrors import describe
from supervisor.watch import memory_owner


class Memory:
    """The memory folder of this node's watchdog, or none (``folder`` None: the tier is off)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.folder: Path | None = None
        self._lock: int | None = None  # the descriptor holding the folder's lock (memory_owner.py)
        # A command that takes no snapshots (no Resumable, the tier off in its loop) hears "no
        # snapshot in memory" once, not at every relaunch: whether the folder was ever seen holding
        # one, and whether its emptiness was said.
        self._held = False
        self._said_empty = False

    def start(self, base: Path, root: Path, node: int, heartbeats_local: bool) -> None:
        """Take the folder's lock, sweep the folders of watchdogs gone without their cleanup
        (memory_owner.py), make the folder, empty (what a watchdog before this one left is not this
        one's to trust); the events say what was swept, and where the folder is or why there is none."""
        if not heartbeats_local:
            self.log.emit(ev.MemoryDir(path=""), "memory tier off: no node-local folder (see heartbeat_dir)")
            return
        folder = node_memory_dir(base, root, node, job_key())
        try:
            self._lock = memory_owner.take(folder, memory_owner.TAKE_WAIT_S)
        except OSError as e:
            self.log.emit(ev.MemoryDir(path=""), f"memory tier off: {folder}'s lock not made ({describe(e)})")
            return
        if self._lock is None:
            self.log.emit(
                ev.MemoryDir(path=""),
                f"memory tier off: {folder} belongs to another watchdog still running on this machine "
                "(the same job, run directory and node: is this watchdog started twice?)",
            )
            return
        swept = memory_owner.sweep(folder.parent.parent, folder)
        if swept:
            freed = sum(s.bytes for s in swept)
            self.log.emit(
                ev.MemorySwept(paths=[s.path for s in swept], bytes=freed),
                f"removed {len(swept)} memory folder(s) of watchdogs gone without their cleanup "
                f"({freed / 2**20:.1f} MiB back): {', '.join(s.path for s in swept)}",
            )
        memsnap.remove(folder)
        try:
            folder.mkdir(mode=0o700)
        except OSError as e:
            self._let_go(folder)
            self.log.emit(ev.MemoryDir(path=""), f"memory tier off: {folder} not made ({describe(e)})")
            return
        self.folder = folder
        self.log.emit(ev.MemoryDir(path=str(folder)), f"memory snapshots of this node's ranks in {folder}")

    def env(self) -> dict[str, str]:
        """What a launch's environment gets: the folder, when there is one."""
        return {MEMORY_DIR_ENV: str(self.folder)} if self.folder is not None else {}

    def pick(
        self,
        launch: int,
        disk_step: int | None,
        stand_in: int | None = None,
        fetch: Callable[[int], str] | None = None,
        committed_only: bool = False,
    ) -> int | None:
        """Before launch number ``launch``: the step of the memory snapshot it resumes from, its
        choice written for its ranks; None: resume from the disk tier (the reason in the events).
        ``stand_in``: this node took lost node ``stand_in``'s place, so its ranks resume from that
        node's replica (``fetch(node)`` brings it here from the buddy that keeps it: '' or why not).
        ``committed_only`` (a job of several nodes): no snapshot newer than the folder's commit, the
        newest step every rank of the job finished: one this node's ranks finished alone may be
        missing on another node. The pick also names the older complete snapshots (not verified
        here): where another node holds no snapshot of the step picked (a replica one push behind),
        the launch's ranks agree on the newest step every node holds, and check it themselves."""
        if self.folder is None:
            return None
        self.note_rejected()
        t0 = time.monotonic()
        rel = "" if stand_in is None else f"{memsnap.REPLICA}/{stand_in}"
        folder = self.folder / rel if rel else self.folder
        fetched = fetch(stand_in) if stand_in is not None and fetch is not None else ""
        indexes, problems = memsnap.read_slots(folder)
        self._held = self._held or (bool(indexes) and not rel)
        reasons = [*([fetched] if fetched else []), *problems]
        snaps = memsnap.complete(folder, indexes)
        if committed_only:
            commit = memsnap.read_commit(folder)
            snaps = [s for s in snaps if commit is not None and s.step <= commit.step]
            if not snaps and indexes:
                reasons.append(f"no snapshot every rank of the job finished ({folder / memsnap.COMMITTED})")
        for i, snap in enumerate(snaps):
            if disk_step is not None and snap.step < disk_step:
                reasons.append(
                    f"the newest complete snapshot, step {snap.step}, is older than step {disk_step} on disk"
                )
                break
            why = memsnap.verify(snap)
            if why:
                reasons.append(why)
                continue
            older = tuple(
                (s.step, s.slot)
                for s in snaps[i + 1 :]
                if s.slot != snap.slot and (disk_step is None or s.step >= disk_step)
            )
            return self._picked(
                launch, snap, older[: memsnap.SLOTS - 1], rel, disk_step, time.monotonic() - t0
            )
        if not indexes and not problems:
            if not rel and not self._held and self._said_empty:
                return None
            self._said_empty = self._said_empty or not rel
            reasons.append(f"no replica of node {stand_in} here" if rel else "no snapshot in memory")
        elif not reasons:
            reasons.append(f"no step that every rank of this node finished ({len(indexes)} rank snapshots)")
        newest = max((ix.step for _, ix in indexes), default=None)
        self._fallback("; ".join(reasons), newest)
        return None

    def _picked(
        self,
        launch: int,
        snap: memsnap.NodeSnapshot,
        older: tuple[tuple[int, int], ...],
        rel: str,
        disk_step: int | None,
        took: float,
    ) -> int:
        assert self.folder is not None
        pick = memsnap.Pick(launch, snap.step, snap.slot, rel, time.time(), older)
        memsnap.write_record(self.folder / memsnap.PICK, pick.to_dict())
        whose = f"the replica of node {rel.rpartition('/')[2]}'s" if rel else "the"
        self.log.emit(
            ev.MemoryPick(
                step=snap.step,
                launch=launch,
                folder=str(snap.folder),
                ranks=len(snap.ranks),
                bytes=snap.size,
                verify_s=round(took, 4),
                disk_step=disk_step,
            ),
            f"resume launch {launch} from {whose} memory snapshot of step {snap.step} ({len(snap.ranks)} ranks, "
            f"{snap.size} bytes, checksums verified in {took:.3f}s; newest on disk: "
            f"{'none' if disk_step is None else f'step {disk_step}'})",
        )
        return snap.step

    def _fallback(self, reason: str, step: int | None, by: str = "watchdog") -> None:
        assert self.folder is not None
        memsnap.clear(self.folder)
        self.log.emit(
            ev.MemoryFallback(reason=reason, step=step, by=by),
            f"memory snapshot not used ({reason}): resuming from the disk tier",
        )

    def note_rejected(self) -> None:
        """The ranks' refusal of a pick (rejected.json), into the event log, once."""
        if self.folder is None:
            return
        rejected = memsnap.read_rejected(self.folder)
        try:
            os.unlink(self.folder / memsnap.REJECTED)
        except OSError:
            return
        if rejected is not None:
            self.log.emit(
                ev.MemoryFallback(reason=rejected.reason, step=rejected.step, by="ranks"),
                f"launch {rejected.launch}'s ranks refused the memory snapshot of step {rejected.step} "
                f"({rejected.reason}): it resumed from the disk tier",
            )

    def remove(self) -> None:
        """The run is over (whatever its end): the memory goes, then its lock."""
        if self.folder is not None:
            memsnap.remove(self.folder)
            self._let_go(self.folder)
            self.folder = None

    def _let_go(self, folder: Path) -> None:
        if self._lock is not None:
            memory_owner.release(folder, self._lock)
            self._lock = None

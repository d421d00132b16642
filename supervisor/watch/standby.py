"""``watch --standby``: the next launch, started ahead of a failure. Its ranks import torch and
then wait (``supervisor.resumable.wait_if_standby``) until the watchdog writes their release file,
so a relaunch skips the interpreter's start and the imports."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format.atomic import atomic_write_text
from supervisor.format.events import EventLog
from supervisor.format.heartbeat import Heartbeat, Mark
from supervisor.format.layout import RunDir
from supervisor.store.ioerrors import describe
from supervisor.watch import process

# Starts launch N as a standby: its id and process.
StartStandby = Callable[[int], tuple[str, process.Child]]
# A standby that exited before it was released (its command fails at start?) is started again
# after this long, not at the next poll.
RETRY_S = 5.0


class Standby:
    def __init__(self, root: Path, host: str, log: EventLog, start: StartStandby) -> None:
        self.run = RunDir.of(root)
        self.host, self.log, self.start = host, log, start
        self.spare: tuple[int, str, process.Child] | None = None  # made for launch N: id, process
        self._retry_at = 0.0  # ``ensure`` starts none before this (time.monotonic)

    @property
    def launch_id(self) -> str | None:
        return self.spare[1] if self.spare else None

    def keep(self, running: process.Child, beats: list[Heartbeat], number: int) -> None:
        """Once the running launch's ranks here have all made a step (not earlier: a standby
        importing torch would slow a recovery on the same cores), start launch ``number`` ahead."""
        if self.spare is not None:
            return
        local = [b for b in beats if b.host == self.host]
        if not local or not all(Mark.FIRST_STEP.value in b.marks for b in local):
            return
        launch_id, spare = self.start(number)
        self.spare = (number, launch_id, spare)
        running.excluded = {spare.pid}
        self.log.emit(
            ev.Standby(launch=number, launch_id=launch_id, pid=spare.pid),
            f"standby for launch {number} (id {launch_id}) started, pid {spare.pid}: released on a relaunch",
        )

    def ensure(self, number: int) -> None:
        """No launch is running (a spare, a node waiting for its roster): start launch ``number``
        ahead now, if none is."""
        if self.spare is not None:
            made_for, _, spare = self.spare
            if made_for == number and spare.poll() is None:
                return
            if spare.poll() is not None:
                self._retry_at = time.monotonic() + RETRY_S
            self.drop(f"made for launch {made_for}" if made_for != number else f"exited {spare.returncode()}")
        if time.monotonic() < self._retry_at:
            return
        launch_id, spare = self.start(number)
        self.spare = (number, launch_id, spare)
        self.log.emit(
            ev.Standby(launch=number, launch_id=launch_id, pid=spare.pid),
            f"standby for launch {number} (id {launch_id}) started, pid {spare.pid}: released when this node launches",
        )

    def take(self, number: int, release: str = "") -> tuple[str, process.Child] | None:
        """Release the standby as launch ``number`` (``release``: what its ranks read in the release
        file, e.g. their group's facts under a roster): None (start cold) without one, or when it
        died meanwhile or was made for another launch (the reason in the event log)."""
        if self.spare is None:
            return None
        made_for, launch_id, spare = self.spare
        self.spare = None
        why = f"exited {spare.returncode()}" if spare.poll() is not None else ""
        why = why or (f"made for launch {made_for}" if made_for != number else "")
        if not why:
            try:
                text = release or f"{time.time()}\n"
                atomic_write_text(self.run.release_file(launch_id), text, self.run.root)
            except OSError as e:
                why = f"its release file could not be written: {describe(e)}"
        if why:
            self.log.emit(ev.Kill(), f"standby {launch_id} not used ({why}): {spare.kill(0.0)}")
            return None
        spare.own_subtree = False
        spare.started, spare.started_mono = time.time(), time.monotonic()
        return launch_id, spare

    def drop(self, why: str = "not needed") -> None:
        """The standby goes, never released (the watchdog is done, or it is no longer wanted)."""
        if self.spare is not None:
            _, launch_id, spare = self.spare
            self.spare = None
            self.log.emit(ev.Kill(), f"standby {launch_id} {why}: {spare.kill(0.0)}")

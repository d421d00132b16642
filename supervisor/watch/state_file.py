"""The watchdog's state file (``supervisor/state.json``): the run's status, its restart budget and
launch history, read once at start (what a previous watchdog of the run left) and rewritten on every
change. Each status change is checked against the run's transition table (format/runstatus.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from supervisor.format import confined, events
from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog, RunState
from supervisor.format.runstatus import RunStatus, check_move
from supervisor.store.ioerrors import describe

T = TypeVar("T")
Publish = Callable[..., None]  # news for the node summary: field=value


class StateFile:
    def __init__(self, initial: RunState, root: Path, log: EventLog, publish: Publish) -> None:
        self.state = initial
        self.log = log
        self.path = events.state_path(root, initial.node)
        self.root = root
        self.publish = publish
        self.error = ""  # why the file is not being written ('' while it is)
        self.loaded = False  # until the previous state is read, writing would clobber its budget

    def load(
        self, read: Callable[[Callable[[], RunState | None], str], RunState | None], reset: bool
    ) -> None:
        """Take the budget and history a previous watchdog left (``read`` retries transient
        storage errors); a garbage file is kept as .bad and the budget starts over."""
        try:
            prev = read(lambda: events.read_state(self.path), f"reading {self.path}")
        except ValueError as e:
            bad = self.path.with_suffix(".json.bad")
            try:
                confined.rename(self.root, self.path, bad)  # through no link below the run dir
                kept = f"the old file is kept as {bad.name}"
            except OSError as err:
                kept = f"the old file could not be moved aside ({describe(err)})"
            self.log.emit(ev.StateUnreadable(), f"{e}; starting with a fresh budget ({kept})")
            prev = None
        self.loaded = True
        if prev is not None and not reset:
            self.state = replace(
                self.state,
                restart_times=prev.restart_times,
                launches=prev.launches,
                launch_count=prev.launch_count,
            )

    def save(self, status: RunStatus | None = None, **changes: object) -> None:
        """Update the state (a status move checked: IllegalTransition) and write it, best effort: on
        failure the state is kept in memory, one line goes to stderr, and the next save writes all."""
        if status is not None:
            changes["status"] = check_move(self.state.status, status)
        # replace() checks each field name at run time; mypy cannot type **changes per field
        self.state = replace(self.state, **changes)  # type: ignore[arg-type]
        st = self.state
        self.publish(
            status=st.status.value,
            reason=st.reason,
            exit_code=st.exit_code,
            launch_count=st.launch_count,
            restarts=len(st.restart_times),
        )
        if not self.loaded:
            return
        try:
            events.write_state(self.root, self.state)
        except OSError as e:
            if not self.error:
                self.error = describe(e)
                events.say(
                    f"[supervisor] state file {self.path} not written ({self.error}); kept in memory, "
                    "written again at the next change"
                )
            return
        if self.error:
            events.say(f"[supervisor] state file written again (it failed with {self.error})")
            self.error = ""

"""Where the tier's events go: the watchdog's event-log format, in a file of their own.

The watchdog's log (supervisor/format/events.py) has one writer per file. The uploader runs inside the
trainer's rank 0, so it writes ``supervisor/events.remote.jsonl`` beside the watchdog's log (read it
as those: ``status`` reads no event log; its remote line comes from ``remote.json``).
``prepare_resume`` runs in the watchdog, which passes its own ``EventLog.emit``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from supervisor.format.events import EventLog
from supervisor.format.eventtypes import Event
from supervisor.format.layout import RunDir

log = logging.getLogger("supervisor.tiers")


class EmitFn(Protocol):
    """``EventLog.emit``'s shape: a typed event (format/eventtypes.py) and a line for an operator."""

    def __call__(self, event: Event, msg: str) -> Any: ...


def remote_event_log(root: str | Path) -> EmitFn:
    """An emitter appending to ``supervisor/events.remote.jsonl``; failures are logged, not raised."""
    elog = EventLog(root, echo=None)
    elog.path = RunDir.of(root).remote_events

    def emit(event: Event, msg: str) -> Any:
        try:
            return elog.emit(event, msg)
        except OSError as e:
            log.warning("remote: cannot append event %s to %s (%s)", event.NAME, elog.path, e)
            return None

    return emit

"""Typed events (supervisor/format/eventtypes.py): every event name has its dataclass, each one
written by EventLog.emit reads back equal, and a line that does not fit is skipped, not a crash."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from supervisor.format import eventtypes as ev
from supervisor.format.eventnames import EventName
from supervisor.format.events import EventLog, events_path, read_events, read_logged

SAMPLES: list[ev.Event] = [
    ev.WatchdogStart(pid=1, command=["torchrun", "x.py"], restarts_carried=2, subreaper=True),
    ev.Pick(checkpoint=None, verify="deep"),
    ev.LaunchEnd(
        launch=3,
        launch_id="L3",
        outcome="hang",
        returncode=-9,
        rank_exit_codes={"0": 75},
        last_step=None,
        newest_checkpoint=40,
    ),
    ev.Hang(ranks=[1, None], detected=1.5, culprits=[{"rank": 1, "frames": []}], waiting_ranks=[0]),
    ev.RootCause(launch=2, rank=0, pid=7, step=12, how="killed", signal=True, consequences=["rank 1: gloo"]),
    ev.Recovery(launch=4, phases={"detected": 0.4, "total": 1.2}),
    ev.Stop(),
]


def test_every_event_name_has_one_dataclass() -> None:
    assert set(ev.BY_NAME) == set(EventName)
    assert all(dataclasses.is_dataclass(c) and c.__dataclass_params__.frozen for c in ev.BY_NAME.values())  # type: ignore[attr-defined]


def test_what_emit_writes_reads_back_as_the_same_event(tmp_path: Path) -> None:
    log = EventLog(tmp_path, echo=None)
    for e in SAMPLES:
        log.emit(e, f"a line about {e.NAME}")
    logged = read_logged(events_path(tmp_path))
    assert [x.event for x in logged] == SAMPLES
    assert [x.msg for x in logged] == [f"a line about {e.NAME}" for e in SAMPLES]
    assert ev.first(logged, ev.Hang) is not None and ev.first(logged, ev.Hang).event.waiting_ranks == [0]  # type: ignore[union-attr]
    raw = read_events(events_path(tmp_path))
    assert raw[0]["event"] == "watchdog_start" and raw[0]["command"] == [
        "torchrun",
        "x.py",
    ]  # the on-disk keys


def test_a_line_that_does_not_fit_is_skipped() -> None:
    good = {"t": 1.0, "node": 0, "event": "relaunch", "msg": "m", "wait_s": 1.0, "restarts": 2}
    assert ev.parse(good) == ev.Logged(1.0, 0, "m", ev.Relaunch(wait_s=1.0, restarts=2))
    for bad in (
        {**good, "restarts": "two"},
        {**good, "restarts": True},
        {k: v for k, v in good.items() if k != "wait_s"},
        {**good, "event": "no_such_event"},
        {**good, "t": "yesterday"},
        {**good, "event": ["relaunch"]},
    ):
        assert ev.parse(bad) is None, bad


@given(
    st.dictionaries(
        st.text(max_size=12),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
            max_leaves=8,
        ),
        max_size=8,
    )
)
def test_any_json_object_parses_or_is_skipped_never_raises(rec: dict[str, Any]) -> None:
    for name in ("hang", "launch_end", "root_cause", "pick"):
        out = ev.parse({**rec, "event": name, "t": 1.0})
        assert out is None or name == out.event.NAME
    json.dumps(rec, default=str)  # the input was JSON-shaped

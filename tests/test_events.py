"""The watchdog's record under a hostile filesystem: a state file with wrong-typed fields is
garbage (ValueError, never a traceback), and the event log survives failed appends (a directory
replaced by a file; a real full disk) without losing or reordering a line once it can write."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from supervisor.format import eventtypes as ev
from supervisor.format.events import (
    EventLog,
    RunState,
    events_path,
    parse_state,
    read_logged,
    read_state,
    state_path,
)
from supervisor.format.launches import LaunchRecord, Outcome

GOOD_LAUNCH = {
    "number": 1,
    "launch_id": "id",
    "started": 1.0,
    "ended": 2.0,
    "outcome": "crash",
    "reason": "exit 1: crash",
    "resumed_from": None,
    "newest_after": 5,
    "last_step": 7,
}


def test_a_good_state_parses_with_ints_for_floats():
    st = parse_state({"launch_count": 3, "started": 5, "exit_code": None, "launches": [GOOD_LAUNCH]})
    assert st.launch_count == 3 and st.started == 5.0 and isinstance(st.started, float)
    assert st.launches == (LaunchRecord(1, "id", 1.0, 2.0, Outcome.CRASH, "exit 1: crash", None, 5, 7),)


@pytest.mark.parametrize(
    ("doc", "names"),
    [
        ({"launch_count": "x"}, "'launch_count' is 'x', not an integer"),
        ({"launch_count": True}, "'launch_count' is True"),
        ({"launches": 5}, "'launches' is 5, not a list"),
        ({"launches": [5]}, "launch record 0 is 5"),
        ({"launches": [dict(GOOD_LAUNCH, number="1")]}, "launch record 0: 'number' is '1'"),
        ({"launches": [dict(GOOD_LAUNCH, outcome="nope")]}, "outcome 'nope' is unknown"),
        ({"launches": [{k: v for k, v in GOOD_LAUNCH.items() if k != "reason"}]}, "has no 'reason'"),
        ({"restart_times": ["x"]}, "'restart_times'"),
        ({"restart_times": 3}, "'restart_times' is 3, not a list"),
        ({"command": "python train.py"}, "'command'"),
        ({"timeouts": {"train": "fast"}}, "'timeouts'"),
        ({"status": 0}, "'status' is 0, not a string"),
        ({"child_pid": 1.5}, "'child_pid' is 1.5"),
        ({"started": "yesterday"}, "'started' is 'yesterday', not a number"),
        ([], "not a JSON object"),
    ],
)
def test_wrong_typed_state_fields_are_garbage_naming_the_field(doc, names):
    with pytest.raises(ValueError) as e:
        parse_state(doc)
    assert names in str(e.value)


def test_read_state_says_which_file(tmp_path: Path):
    path = state_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"launch_count": "x"}))
    with pytest.raises(ValueError, match=f"{path}: 'launch_count'"):
        read_state(path)
    path.write_text("[" * 100_000)  # deep garbage: a ValueError too, not a RecursionError
    with pytest.raises(ValueError):
        read_state(path)
    assert read_state(tmp_path / "missing.json") is None


def test_event_log_keeps_lines_while_it_cannot_write_and_appends_them_in_order(tmp_path: Path):
    echo = io.StringIO()
    log = EventLog(tmp_path, echo=echo)
    log.emit(ev.IoRetry(), "first")
    sup = events_path(tmp_path).parent
    shutil.rmtree(sup)
    sup.write_text("not a directory")  # every append now fails for real: ENOTDIR
    log.emit(ev.Stop(), "second")
    log.emit(ev.StateUnreadable(), "third")
    assert log.pending and log.error is not None
    assert "second" in echo.getvalue() and "third" in echo.getvalue()  # the message still reaches a person
    sup.unlink()
    sup.mkdir()
    log.emit(ev.RemoteUnavailable(), "fourth")
    assert not log.pending and log.error is None
    assert [e.event for e in read_logged(events_path(tmp_path))] == [
        ev.Stop(),
        ev.StateUnreadable(),
        ev.RemoteUnavailable(),
    ]  # the first went with the dir


def test_event_log_rides_out_a_full_disk(small_tmpfs, capfd):
    root = small_tmpfs.path / "run"
    log = EventLog(root, echo=None)
    log.emit(ev.IoRetry(), "before the disk ran full")
    small_tmpfs.fill()
    for i in range(50):
        log.emit(ev.Relaunch(wait_s=0.0, restarts=i), f"while full {i}")
    assert log.pending
    err = capfd.readouterr().err
    assert err.count("not written") == 1 and "No space left on device" in err  # once per streak
    small_tmpfs.free()
    log.emit(ev.Stop(), "space again")
    assert "written again" in capfd.readouterr().err
    evs = read_logged(events_path(root))
    assert [e.event.NAME for e in evs] == ["io_retry", *["relaunch"] * 50, "stop"]
    assert [e.event.restarts for e in ev.every(evs, ev.Relaunch)] == list(range(50))


def test_event_log_buffer_is_bounded(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(EventLog, "MAX_PENDING_BYTES", 2000)
    (tmp_path / "supervisor").write_text("not a directory")
    log = EventLog(tmp_path, echo=None)
    for i in range(100):
        log.emit(ev.Relaunch(wait_s=0.0, restarts=i), "x" * 50)
    assert len(log.pending) <= 2000 and log.dropped > 0
    kept = len(log.pending.splitlines())
    (tmp_path / "supervisor").unlink()
    log.emit(ev.Stop(), "back")
    evs = read_logged(events_path(tmp_path))
    assert len(evs) == kept + 1 and evs[0].event == ev.Relaunch(wait_s=0.0, restarts=0)  # the oldest are kept


def test_state_round_trip(tmp_path: Path):
    from supervisor.format.events import write_state

    st = RunState(status="running", restart_times=(1.5,), command=("a", "b"), timeouts={"train": 3.0})
    write_state(tmp_path, st)
    back = read_state(state_path(tmp_path))
    assert back is not None and back.restart_times == (1.5,) and back.command == ("a", "b")
    assert back.timeouts == {"train": 3.0}

"""The run's status as a state machine (supervisor/format/runstatus.py), and the watchdog's state
file enforcing it (supervisor/watch/state_file.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.format.events import EventLog, RunState, parse_state, read_state
from supervisor.format.runstatus import MOVES, IllegalTransition, RunStatus, check_move
from supervisor.watch.state_file import StateFile

ENDS = [s for s in RunStatus if s.ended]


def test_the_table_is_the_diagram() -> None:
    assert set(ENDS) == {RunStatus.DONE, RunStatus.REQUEUED, RunStatus.STOPPED, RunStatus.FAILED}
    assert MOVES[RunStatus.RESTARTING] == {RunStatus.RUNNING, *ENDS} - {RunStatus.DONE}
    assert MOVES[RunStatus.RUNNING] == {RunStatus.RESTARTING, *ENDS}
    assert all(check_move(s, s) == s for s in RunStatus)  # a reason changing is no move


@pytest.mark.parametrize("old", ENDS)
@pytest.mark.parametrize("new", [RunStatus.RUNNING, RunStatus.RESTARTING])
def test_an_ended_run_never_moves_again(old: RunStatus, new: RunStatus) -> None:
    with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value} is not allowed"):
        check_move(old, new)


def test_done_only_after_a_launch() -> None:
    with pytest.raises(IllegalTransition, match="from restarting: running, requeued, stopped, failed"):
        check_move(RunStatus.RESTARTING, RunStatus.DONE)


def test_the_state_file_refuses_an_illegal_move_and_keeps_the_last_good_state(tmp_path: Path) -> None:
    published: list[dict[str, object]] = []
    sf = StateFile(RunState(), tmp_path, EventLog(tmp_path, 0), lambda **f: published.append(f))
    sf.load(lambda fn, _what: fn(), reset=False)
    sf.save(RunStatus.RUNNING, reason="launch 1 running", launch_count=1)
    sf.save(RunStatus.DONE, reason="finished", exit_code=0)
    with pytest.raises(IllegalTransition):
        sf.save(RunStatus.RUNNING, reason="launch 2 running")
    on_disk = read_state(sf.path)
    assert on_disk is not None and on_disk.status is RunStatus.DONE and on_disk.reason == "finished"
    assert [p["status"] for p in published] == ["running", "done"]


def test_an_unknown_status_on_disk_is_garbage_not_a_crash() -> None:
    with pytest.raises(ValueError, match="'status' is 'dancing'"):
        parse_state({"status": "dancing"})
    assert parse_state({"status": "running"}).status is RunStatus.RUNNING

"""Rank 0's metrics lines held for the memory tier (supervisor/resumable/_steplog.py): a
snapshotted step's line, and every line after it, wait for an exchange past its mark at which no
copy ran; the order is the steps' order; held lines are written when the run finishes, dropped
when a launch stops otherwise."""

from __future__ import annotations

from pathlib import Path

from supervisor.format.appender import LineAppender
from supervisor.resumable._steplog import HELD_MAX, StepLog


def _log(tmp_path: Path) -> tuple[StepLog, Path]:
    path = tmp_path / "metrics.jsonl"
    return StepLog(LineAppender(path, tmp_path)), path


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_snapshotted_steps_line_and_those_behind_it_wait_for_a_settled_exchange(tmp_path):
    log, path = _log(tmp_path)
    log.write("1")  # no snapshot: written now
    log.write("2", after=5)  # its copy began at exchange 5
    log.write("3")  # behind it
    log.release(5)  # the exchange it began at proves nothing
    assert _lines(path) == ["1"]
    log.release(6)
    assert _lines(path) == ["1", "2", "3"]
    log.write("4")
    assert _lines(path) == ["1", "2", "3", "4"]


def test_a_newer_snapshot_behind_a_held_one_keeps_the_later_mark(tmp_path):
    log, path = _log(tmp_path)
    log.write("1", after=3)
    log.write("2", after=7)
    log.release(4)
    assert _lines(path) == []
    log.release(8)
    assert _lines(path) == ["1", "2"]


def test_held_lines_are_written_when_the_run_finishes_and_never_more_than_the_bound_wait(tmp_path):
    log, path = _log(tmp_path)
    log.write("0", after=1)
    for i in range(1, HELD_MAX):
        log.write(str(i))
    assert _lines(path) == []
    log.write(str(HELD_MAX))  # one more than the bound: all of them go
    assert _lines(path) == [str(i) for i in range(HELD_MAX + 1)]
    log.write("last", after=9)
    log.close(finished=True)
    assert _lines(path)[-1] == "last"


def test_a_launch_that_stops_unfinished_drops_its_held_lines(tmp_path):
    """Not known to be in every rank's memory: the relaunch writes the line (resumed at its step)
    or trains the step again."""
    log, path = _log(tmp_path)
    log.write("1")
    log.write("2", after=4)
    log.close(finished=False)
    assert _lines(path) == ["1"]

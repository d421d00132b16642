"""The recovery breakdown (supervisor/watch/recovery.py): pure functions of wall times."""

from __future__ import annotations

from supervisor.format.heartbeat import Heartbeat, Mark, Phase
from supervisor.watch.recovery import Moment, breakdown, complete, describe, rank_moments


def beat(rank: int, host: str = "h", **marks: float) -> Heartbeat:
    return Heartbeat(rank, rank, host, 100 + rank, 5, Phase.TRAIN, 0.0, marks=marks)


def test_rank_moments_wait_for_every_local_rank_and_take_the_slowest():
    beats = [
        beat(0, torch_imported=3.0, first_step=9.0),
        beat(1, torch_imported=4.0),
        beat(2, host="other", torch_imported=99.0, first_step=99.0),
    ]
    at = rank_moments(beats, "h")
    assert at == {Moment.TORCH_IMPORTED: 4.0}  # rank 1 has no first step yet; other hosts do not count
    assert not complete(at)
    assert rank_moments([], "h") == {}


def test_breakdown_in_order_with_moments_passed_ahead_counted_as_zero():
    """A standby's process and imports predate the failure: 0 s, and the next phase counts from
    the latest moment before it, so the phases add up to the total."""
    at = {
        Moment.DETECTED: 10.0,
        Moment.TREE_KILLED: 10.5,
        Moment.CHECKPOINT_PICKED: 10.75,
        Moment.PROCESS_STARTED: 11.0,
        Moment.WORKER_STARTED: 2.0,  # started long before
        Moment.TORCH_IMPORTED: 5.0,
        Moment.RENDEZVOUS_DONE: 11.25,
        Moment.FIRST_STEP: 13.0,
    }
    phases = breakdown(at)
    assert phases == {
        "tree_killed": 0.5,
        "checkpoint_picked": 0.25,
        "process_started": 0.25,
        "worker_started": 0.0,
        "torch_imported": 0.0,
        "rendezvous_done": 0.25,
        "first_step": 1.75,
        "total": 3.0,
    }
    assert complete(at)
    assert describe(phases).startswith("3.00s to the first step: tree killed 0.50s, checkpoint picked 0.25s")
    assert breakdown({Moment.FIRST_STEP: 1.0}) == {}
    # the failed rank's last heartbeat known: the recovery starts there, detection is its first phase
    seen = breakdown({**at, Moment.FAILED: 9.0})
    assert list(seen)[:2] == ["detected", "tree_killed"] and seen["detected"] == 1.0 and seen["total"] == 4.0


def test_describe_keeps_the_order_of_a_sorted_file_and_says_when_unfinished():
    phases = {"total": 1.0, "tree_killed": 0.25, "backed_off": 0.75}  # as a sorted JSON file has it
    assert describe(phases) == "1.00s without reaching the first step: tree killed 0.25s, backed off 0.75s"
    assert describe({}) == ""


def test_mark_names_are_moment_names():
    assert {m.value for m in Mark} <= {m.value for m in Moment}

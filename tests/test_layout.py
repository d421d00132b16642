"""Run-directory names: round trips, and names that must not be mistaken for checkpoints."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.format import layout
from supervisor.format.layout import (
    RunDir,
    deleting_dirname,
    launch_id,
    launch_node,
    looks_like_run_dir,
    parse_committed,
    parse_deleting,
    parse_tmp,
    safe_host,
    step_dirname,
    tmp_dirname,
)
from supervisor.format.metrics import MetricsRecord, parse_line, read_metrics
from supervisor.watch import launch_dirs


@settings(derandomize=True, max_examples=200)
@given(st.integers(0, 10**layout.STEP_DIGITS - 1))
def test_step_dirname_round_trips(step: int) -> None:
    assert parse_committed(step_dirname(step)) == step
    assert parse_tmp(step_dirname(step)) is None


@settings(derandomize=True, max_examples=200)
@given(st.integers(0, 10**8 - 1), st.integers(1, 2**22), st.text(min_size=0, max_size=20))
def test_tmp_and_deleting_names_round_trip_and_are_never_checkpoints(step: int, pid: int, host: str) -> None:
    tmp = tmp_dirname(step, pid, host)
    t = parse_tmp(tmp)
    assert t is not None and (t.step, t.pid) == (step, pid)
    assert parse_committed(tmp) is None and parse_deleting(tmp) is None
    dele = deleting_dirname(step, pid, host)
    d = parse_deleting(dele)
    assert d is not None and (d.step, d.pid, d.host) == (step, pid, t.host)
    assert parse_committed(dele) is None and parse_tmp(dele) is None


@pytest.mark.parametrize("step", [-1, 10**8])
def test_step_out_of_range_is_refused(step: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        step_dirname(step)


@pytest.mark.parametrize(
    "name",
    [
        "step_00000050\n",  # a trailing newline: `$` alone would accept it
        "step_0000005",
        "step_000000500",
        "step_٠٠٠٠٠٠٥٠",  # non-ASCII digits
        "step_00000050.tmp",
        "xstep_00000050",
        "step_00000050/",
        "",
    ],
)
def test_near_misses_are_not_committed(name: str) -> None:
    assert parse_committed(name) is None


def test_tmp_host_is_sanitized() -> None:
    name = tmp_dirname(5, 42, "node.cluster/evil name")
    assert "/" not in name and " " not in name
    assert parse_tmp(name) is not None


def test_run_dir_paths() -> None:
    r = RunDir.of("/x")
    assert str(r.checkpoint(50)) == "/x/step_00000050"
    assert str(r.heartbeat(3)) == "/x/heartbeats/rank_00003.json"
    assert str(r.stack_dump(3)) == "/x/heartbeats/stacks_rank_00003.txt"
    assert (r.latest.name, r.quarantine.name, r.lock.name) == ("latest", "quarantine", ".lock")
    # the names written by the watchdog(s), the uploader, SLURM's hooks and the trainer: the format
    assert [str(p) for p in (r.state(), r.state(2), r.events(), r.events(2))] == [
        "/x/supervisor/state.json",
        "/x/supervisor/state.node2.json",
        "/x/supervisor/events.jsonl",
        "/x/supervisor/events.node2.jsonl",
    ]
    assert [str(p) for p in (r.remote_status, r.remote_events, r.requeue_state)] == [
        "/x/supervisor/remote.json",
        "/x/supervisor/events.remote.jsonl",
        "/x/supervisor/slurm.json",
    ]
    assert [str(p) for p in (r.metrics, r.final, r.samples(3))] == [
        "/x/metrics.jsonl",
        "/x/final.json",
        "/x/samples/rank_00003.jsonl",
    ]
    assert layout.rank_state_filename(3) == "rank_00003.state.pt"


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("rank_00003.json", 3),
        ("rank_12345.json", 12345),
        ("rank_.json", None),
        ("rank_00003.json.tmp", None),
        ("stacks_rank_00003.txt", None),
        ("rank_00003.state.pt", None),
        ("rank_x.json", None),
    ],
)
def test_heartbeat_file_names(name: str, rank: int | None) -> None:
    assert layout.parse_heartbeat_filename(name) == rank
    if rank is not None:
        assert layout.heartbeat_filename(rank) == name


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ([], True),
        ([".lock"], True),
        (["step_00000050", "notes.txt"], True),
        (["latest"], True),
        (["heartbeats", "supervisor"], True),
        (["supervisor"], True),  # a watchdog that has not launched the trainer yet
        (["supervisor", "pyproject.toml", "tests"], False),  # a source checkout
        (["Documents", "Downloads"], False),
        (["manifest.json", "__0_0.distcp"], False),
        ([".bashrc", "data"], False),
    ],
)
def test_looks_like_run_dir(names: list[str], expected: bool) -> None:
    assert looks_like_run_dir(names) is expected


def test_a_metrics_record_round_trips_and_a_partial_line_is_no_record(tmp_path):
    rec = MetricsRecord(
        step=7, loss=2.5, lr=1e-3, grad_norm=0.25, step_time=0.1, restart_count=1, launch="L2"
    )
    assert parse_line(rec.to_line()) == rec
    assert parse_line(rec.to_line()[:20]) is None  # still being written, or cut by a full disk
    # A trainer's own metrics (Resumable.step_end) travel as extra keys of the same line.
    mine = MetricsRecord.of(3, {"loss": 1.0, "lr": 0.1, "accuracy": 0.75}, 0, "L1")
    assert mine.extra == {"accuracy": 0.75} and parse_line(mine.to_line()) == mine
    assert parse_line('{"step": 1, "loss": 1.0, "lr": 0.1, "note": "x"}') == MetricsRecord(1, 1.0, 0.1)
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    path.write_text(rec.to_line() + "\n" + rec.to_line()[:9])
    assert read_metrics(path) == [rec]


@settings(derandomize=True, max_examples=200)
@given(
    host=st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
    node=st.integers(0, 100_000),
    pid=st.integers(1, 2**22),
    number=st.integers(1, 10_000),
)
def test_a_launch_id_names_its_node_whatever_the_host(host, node, pid, number):
    assert launch_node(safe_host(launch_id(host, node, pid, number, "a1b2c3"))) == node


def test_launch_dirs_stale_are_this_nodes_unrecorded_ones_only():
    mine_kept, mine_old = launch_id("vm-a", 0, 7, 3, "aaaaaa"), launch_id("vm-a", 0, 7, 1, "bbbbbb")
    theirs = launch_id("vm-b", 1, 9, 1, "cccccc")
    names = [mine_kept, mine_old, theirs, "notes", "x-n0-1"]
    assert launch_dirs.stale(names, 0, keep=[mine_kept]) == [mine_old]
    assert launch_dirs.stale(names, 1, keep=[]) == [theirs]

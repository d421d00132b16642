"""Heartbeats: round trip, throttled writer, and readers that never crash on a bad file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.format.capped import read_capped
from supervisor.format.heartbeat import (
    ENV_LAUNCH_ID,
    ENV_RESTART_COUNT,
    Heartbeat,
    HeartbeatWriter,
    Mark,
    Phase,
    parse_heartbeat,
    read_heartbeat,
    read_heartbeats,
    write_heartbeat,
)
from supervisor.format.layout import RunDir
from supervisor.watch.liveness import Clock


def _hb(rank: int = 3, **kw) -> Heartbeat:
    base = dict(rank=rank, local_rank=1, host="node7", pid=1234, step=50, phase=Phase.TRAIN, wall_time=1e9)
    return Heartbeat(**{**base, **kw})


def test_round_trip(tmp_path: Path) -> None:
    hb = _hb(restart_count=2, world_size=8, last_step_s=0.25, launch_id="L1", exit_code=75)
    write_heartbeat(tmp_path, hb)
    snap = read_heartbeat(RunDir.of(tmp_path).heartbeat(3), 3)
    assert snap.known and snap.heartbeat == hb and snap.problem == ""


def test_read_heartbeats_sorts_by_rank_and_ignores_other_files(tmp_path: Path) -> None:
    for r in (2, 0, 1):
        write_heartbeat(tmp_path, _hb(rank=r))
    folder = RunDir.of(tmp_path).heartbeats
    (folder / "stacks_rank_00001.txt").write_text("stack")
    (folder / ".rank_00000.json.abc.tmp").write_text("{half")  # an interrupted atomic write
    (folder / "rank_abc.json").write_text("{}")
    assert [s.rank for s in read_heartbeats(tmp_path)] == [0, 1, 2]
    assert all(s.known for s in read_heartbeats(tmp_path))


def test_missing_folder_reads_as_nothing(tmp_path: Path) -> None:
    assert read_heartbeats(tmp_path / "nope") == []


def _full() -> dict:
    return _hb().to_dict()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "not valid JSON"),
        (b'{"rank": 3, "local_r', "not valid JSON"),  # half written (a non-atomic writer)
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({k: v for k, v in _full().items() if k != "step"}).encode(), "field 'step' missing"),
        (json.dumps({**_full(), "phase": "dancing"}).encode(), "bad field"),
        (json.dumps({**_full(), "step": "50"}).encode(), "bad field"),
        (json.dumps({**_full(), "rank": True}).encode(), "bad field"),
        (json.dumps({**_full(), "wall_time": "soon"}).encode(), "bad field"),
        (json.dumps({**_full(), "wall_time": 10**400}).encode(), "bad field"),
        (json.dumps({**_full(), "phase": ["train"]}).encode(), "bad field"),
        (json.dumps({**_full(), "rank": 4}).encode(), "says rank 4"),
        (json.dumps({**_full(), "marks": [1.0]}).encode(), "bad field"),
        (json.dumps({**_full(), "marks": {"first_step": "soon"}}).encode(), "bad field"),
    ],
)
def test_bad_files_read_as_unknown_with_a_reason(tmp_path: Path, content: bytes, problem: str) -> None:
    p = tmp_path / "rank_00003.json"
    p.write_bytes(content)
    snap = read_heartbeat(p, 3)
    assert not snap.known and snap.heartbeat is None and problem in snap.problem


@pytest.mark.parametrize("size", [0, 1, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 3 << 16])
def test_read_capped_reads_a_file_whole_at_any_size(tmp_path: Path, size: int) -> None:
    """One read per small file: it must still read on past a read that filled its buffer."""
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert read_capped(tmp_path / "f", 3 << 16) == data


def test_missing_and_directory_read_as_unknown(tmp_path: Path) -> None:
    assert read_heartbeat(tmp_path / "rank_00003.json", 3).problem == "missing"
    (tmp_path / "rank_00004.json").mkdir()
    assert "unreadable" in read_heartbeat(tmp_path / "rank_00004.json", 4).problem


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hb")


@settings(derandomize=True, max_examples=300)
@given(
    st.binary(max_size=300)
    | st.dictionaries(
        st.sampled_from([*list(_full()), "x"]),
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=5)
        | st.lists(st.integers()),
    ).map(lambda d: json.dumps(d).encode())
)
def test_arbitrary_content_never_crashes_a_reader(scratch: Path, content: bytes) -> None:
    p = scratch / "rank_00003.json"
    p.write_bytes(content)
    snap = read_heartbeat(p, 3)
    assert snap.known or snap.problem


def test_writer_throttles_within_a_phase_and_writes_on_change(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_RESTART_COUNT, "4")
    monkeypatch.setenv(ENV_LAUNCH_ID, "launch-9")
    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, world_size=2, interval_s=3600)
    assert w.beat(1, Phase.TRAIN)
    assert not w.beat(2, Phase.TRAIN)  # throttled
    assert w.beat(3, Phase.SAVE)  # phase change
    assert w.beat(4, Phase.SAVE, force=True)
    assert w.beat(5, Phase.SAVE, exit_code=75)
    hb = read_heartbeat(RunDir.of(tmp_path).heartbeat(0), 0).heartbeat
    assert (hb.step, hb.phase, hb.exit_code, hb.restart_count, hb.launch_id, hb.pid) == (
        5,
        Phase.SAVE,
        75,
        4,
        "launch-9",
        os.getpid(),
    )
    assert not [n for n in os.listdir(RunDir.of(tmp_path).heartbeats) if n.startswith(".")]


def test_a_heartbeat_without_the_newer_fields_still_reads(tmp_path: Path) -> None:
    """Heartbeats written before progress, monotonic time and save failures were recorded."""
    old = {k: v for k, v in _hb().to_dict().items() if k in ("rank", "local_rank", "host", "pid", "step")}
    path = RunDir.of(tmp_path).heartbeat(3)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**old, "phase": "train", "wall_time": 1e9}))
    hb = read_heartbeat(path, 3).heartbeat
    assert hb is not None and (hb.progress, hb.io_path, hb.mono_time, hb.save_failures) == (0, "", 0.0, 0)


def test_a_failed_write_never_raises_and_the_next_beat_retries(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.write_text("a file where the run directory should be: every heartbeat write fails")
    w = HeartbeatWriter(root, rank=1, local_rank=1, world_size=2, interval_s=3600)
    assert not w.beat(1, Phase.TRAIN)
    assert not w.beat(2, Phase.TRAIN)
    assert w.write_errors == 2
    root.unlink()
    root.mkdir()
    assert w.beat(3, Phase.TRAIN)  # not throttled: nothing has landed since the failures
    assert w.write_errors == 0
    assert read_heartbeat(RunDir.of(root).heartbeat(1), 1).heartbeat.step == 3


def test_progress_tracker_beats_with_progress_path_and_save_failures(tmp_path: Path) -> None:
    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, world_size=1, interval_s=0.0)
    w.save_failures, w.last_error = 2, "step_00000010: No space left on device"
    track = w.tracker(Phase.VERIFY, step=10, total=300)
    track.set_path("step_00000010/__0_0.distcp")
    track(100)
    track(50)
    hb = read_heartbeat(RunDir.of(tmp_path).heartbeat(0), 0).heartbeat
    assert (hb.phase, hb.step, hb.progress, hb.progress_total) == (Phase.VERIFY, 10, 150, 300)
    assert hb.io_path == "step_00000010/__0_0.distcp"
    assert (hb.save_failures, hb.last_error) == (2, "step_00000010: No space left on device")
    assert hb.boot_id and hb.mono_time > 0


class _Clocked:
    """heartbeat.time for a test, moved by the test (``now``), and rank 0's heartbeat as last
    written under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.now = 1000.0

    def time(self) -> float:
        return 1e9 + self.now

    def monotonic(self) -> float:
        return self.now

    def written(self) -> Heartbeat:
        hb = read_heartbeat(RunDir.of(self.root).heartbeat(0), 0).heartbeat
        assert hb is not None
        return hb

    def silence(self) -> float:
        """The written heartbeat's silence now, as the watchdog measures it."""
        hb = self.written()
        return Clock(wall=self.time(), mono=self.now, boot_id=hb.boot_id).silence(hb)


@pytest.fixture
def clocked(tmp_path: Path, monkeypatch) -> _Clocked:
    clock = _Clocked(tmp_path)
    monkeypatch.setattr("supervisor.format.heartbeat.time", clock)
    return clock


def test_progress_is_stamped_when_it_changes_not_when_a_beat_is_written(clocked: _Clocked) -> None:
    """Issue 44: a wait that rewrote the heartbeat every second hid a hang for ten minutes. The
    writer stamps the last change of (phase, step, progress); a beat that changes none of them,
    a wait's, moves the write time only, and says what it waits for."""
    w = HeartbeatWriter(clocked.root, rank=0, local_rank=0, world_size=2, interval_s=0.0)
    now = clocked.written
    track = w.tracker(Phase.SAVE, step=20)
    track(4096)
    clocked.now += 5
    track.wait("every rank's report of the save", until=1e9 + 1100)
    clocked.now += 5
    track(0)  # a beat of nothing
    hb = now()
    assert (hb.mono_time, hb.progress_mono, hb.progress_wall) == (1010.0, 1000.0, 1e9 + 1000)
    assert (hb.waiting, hb.wait_until) == ("", 0.0), "a beat that is not a wait clears it"
    track.wait("every rank's report of the save", until=1e9 + 1100)
    assert (now().waiting, now().wait_until, now().progress_mono) == (
        "every rank's report of the save",
        1e9 + 1100,
        1000.0,
    )
    clocked.now += 1
    track(1)  # a byte: progress
    assert (now().progress_mono, now().waiting) == (1011.0, "")
    clocked.now += 1
    w.beat(20, Phase.COMMIT)  # another phase: progress
    assert now().progress_mono == 1012.0
    clocked.now += 1
    w.beat(21, Phase.COMMIT)  # another step: progress
    assert now().progress_mono == 1013.0
    assert parse_heartbeat(json.dumps(now().to_dict())) == now()


def test_a_rank_that_waited_between_files_is_silent_from_its_next_file_not_from_before_its_wait(
    clocked: _Clocked,
) -> None:
    """A CI run's false hang: rank 0 read its shard, waited 13 s in DCP's load for rank 1 (beats
    as a wait: held to its launch's progress), then opened its per-rank file. That beat, a wait
    no more, carried the stamp of the shard's last byte, and a look before the next write found
    rank 0 silent 13 s (load timeout 5 s). A file opened is progress; one that never returns
    still goes silent from its opening, and the same file named again is none."""
    w = HeartbeatWriter(clocked.root, rank=0, local_rank=0, world_size=2, interval_s=1.0)
    track = w.tracker(Phase.LOAD, step=20)
    track.set_path("step_00000020/__0_0.distcp")
    track(390208)
    track.set_path("")
    for _ in range(26):
        clocked.now += 0.5
        track.wait("peers in DCP's exchanges")
    assert clocked.silence() == 13.0  # a wait: the watchdog holds it to its peers' progress instead
    track.set_path("step_00000020/rank_00000.state.pt")  # written at once: a new file
    assert clocked.silence() == 0.0
    clocked.now += 6.0
    track.set_path("step_00000020/rank_00000.state.pt")  # the same file: no progress
    track(0)
    assert clocked.silence() == 6.0, "stuck in the open: silent from it"


def test_a_new_io_path_is_written_at_once_whatever_the_throttle(tmp_path: Path) -> None:
    """A read that blocks must find its file named in the heartbeat written before it."""
    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, world_size=1, interval_s=3600.0)
    track = w.tracker(Phase.LOAD, step=10)
    track(10)  # throttled: not written
    track.set_path("step_00000010/__1_0.distcp")
    hb = read_heartbeat(RunDir.of(tmp_path).heartbeat(0), 0).heartbeat
    assert (hb.io_path, hb.progress) == ("step_00000010/__1_0.distcp", 10)
    track(10)
    track.set_path("step_00000010/__1_0.distcp")  # the same file: throttled like progress
    assert read_heartbeat(RunDir.of(tmp_path).heartbeat(0), 0).heartbeat.progress == 10


def test_marks_ride_every_beat_and_the_first_step_is_written_at_once(tmp_path: Path) -> None:
    """Marks set by the trainer go out with the next beat; the first train beat with a step time
    marks FIRST_STEP and is written whatever the throttle (the watchdog times a recovery by it),
    once: later steps keep its time."""
    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, world_size=1, interval_s=3600)
    w.mark(Mark.TORCH_IMPORTED, 100.0)
    w.mark(Mark.TORCH_IMPORTED, 200.0)  # the first time counts
    assert w.beat(0, Phase.TRAIN, force=True)  # the loop's first beat, before any step
    assert w.beat(1, Phase.TRAIN, last_step_s=0.1)  # throttled, but the first step
    first = read_heartbeat(RunDir.of(tmp_path).heartbeat(0), 0).heartbeat
    assert first is not None and first.marks[Mark.TORCH_IMPORTED.value] == 100.0
    assert first.marks[Mark.FIRST_STEP.value] == pytest.approx(first.wall_time)
    assert not w.beat(2, Phase.TRAIN, last_step_s=0.1)  # throttled again
    assert w.beat(3, Phase.SAVE)
    later = read_heartbeat(RunDir.of(tmp_path).heartbeat(0), 0).heartbeat
    assert later is not None and later.marks == first.marks

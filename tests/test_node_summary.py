"""Node-local heartbeats and the node summary: the path rule, the writer's folder, the summary a
watchdog publishes (pure, then from a real watchdog over the fake trainer), and `status` reading
summaries (fresh, stale, garbage, a big run counted from headers)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
from test_watch import start
from watch_helpers import finish

from supervisor.cli.status import render
from supervisor.format.events import RunState, write_state
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import (
    Heartbeat,
    HeartbeatWriter,
    Phase,
    read_heartbeat_folder,
    write_heartbeat,
    write_heartbeat_in,
)
from supervisor.format.layout import (
    HEARTBEAT_DIR_ENV,
    NODE_DIR_ENV,
    RunDir,
    node_heartbeat_dir,
    node_local_base,
    parse_node_summary_filename,
)
from supervisor.format.nodesummary import (
    SummaryHeader,
    _parse_header_slowly,
    parse_header,
    read_run_heartbeats,
    read_summary,
    write_summary,
)
from supervisor.report import build_report
from supervisor.watch.liveness import Clock, PhaseTimeouts
from supervisor.watch.node_summary import NodeFacts, Publisher, build_summary, choose_folder

LID = "vm-n0-1-1-abc"
TIMEOUTS = PhaseTimeouts(train=10.0)


def hb(rank: int, step: int = 7, phase: Phase = Phase.TRAIN, t: float = 1000.0, **kw) -> Heartbeat:
    return Heartbeat(rank, rank % 8, f"h{rank // 8}", 100 + rank, step, phase, t, launch_id=LID, **kw)


def test_path_rule_keys_user_job_run_and_node(tmp_path):
    a = node_heartbeat_dir(tmp_path, tmp_path / "run", 0, "local")
    assert a.parent.parent == tmp_path / f"supervisor-{os.getuid()}"
    others = {
        node_heartbeat_dir(tmp_path, tmp_path / "run", 1, "local"),
        node_heartbeat_dir(tmp_path, tmp_path / "run", 0, "4242"),
        node_heartbeat_dir(tmp_path, tmp_path / "other", 0, "local"),
    }
    assert a not in others and len(others) == 3
    assert node_heartbeat_dir(tmp_path, Path("run"), 0, "j") == node_heartbeat_dir(
        tmp_path, Path.cwd() / "run", 0, "j"
    )
    assert parse_node_summary_filename(RunDir.of(tmp_path).node_summary(12).name) == 12
    assert parse_node_summary_filename("rank_00012.json") is None


def test_base_env_then_shm_then_tmpdir(tmp_path, monkeypatch):
    assert node_local_base({NODE_DIR_ENV: str(tmp_path)}) == tmp_path
    monkeypatch.setattr("supervisor.format.layout.SHM", str(tmp_path / "no-shm"))
    assert node_local_base({"TMPDIR": str(tmp_path / "t")}) == tmp_path / "t"
    assert node_local_base({}) == Path("/tmp")


def test_writer_uses_the_folder_its_watchdog_names(tmp_path, monkeypatch):
    root, local = tmp_path / "run", tmp_path / "shm" / "node0"
    HeartbeatWriter(root, rank=1, local_rank=1, world_size=2).beat(3, Phase.TRAIN)
    assert [s.rank for s in read_heartbeat_folder(RunDir.of(root).heartbeats)] == [1]  # no watchdog
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(local))
    HeartbeatWriter(root, rank=0, local_rank=0, world_size=2).beat(3, Phase.TRAIN)
    assert [s.rank for s in read_heartbeat_folder(local)] == [0]
    assert [s.rank for s in read_heartbeat_folder(RunDir.of(root).heartbeats)] == [1]


def test_summary_flags_ranks_that_need_a_look_and_carries_records_whole(tmp_path):
    folder = tmp_path / "node"
    write_heartbeat_in(folder, hb(0, t=995))
    write_heartbeat_in(folder, hb(1, t=980))  # silent 20 s > train timeout 10 s
    write_heartbeat_in(folder, hb(2, step=6, phase=Phase.SAVE, t=980))  # a long save is fine
    write_heartbeat_in(folder, hb(3, t=999, save_failures=2, last_error="ENOSPC"))
    (folder / "rank_00004.json").write_text("{garbage")
    rec = json.loads((folder / "rank_00000.json").read_text())
    (folder / "rank_00000.json").write_text(json.dumps({**rec, "custom_phase": "eval"}))
    facts = NodeFacts(3, "h0", 55, 5.0, launch_id=LID, verdict="launch 1: crash", culprit="rank 1")
    header, records, problems = build_summary(read_heartbeat_folder(folder), facts, Clock(1000.0), TIMEOUTS)
    assert header.attention == (1, 3, 4)
    assert (header.ranks, header.phases) == (5, {"train": 3, "save": 1})
    assert (header.step_min, header.step_max, header.live_step_max) == (6, 7, 7)
    assert header.stale_after_s == 15.0 and header.wall_time == 1000.0
    assert records[0]["custom_phase"] == "eval"  # a field this code does not know travels
    assert [p.rank for p in problems] == [4] and "JSON" in problems[0].problem
    # a new launch makes the old records need a look too
    other = build_summary(
        read_heartbeat_folder(folder), NodeFacts(3, "h0", 55, 5.0, launch_id="L2"), Clock(1000.0), TIMEOUTS
    )
    assert other[0].attention == (0, 1, 2, 3, 4)


def test_publisher_writes_one_file_and_cleans_the_node_folder_at_stop(tmp_path):
    root, folder = tmp_path / "run", tmp_path / "shm" / "job" / "node0"
    for r in range(3):
        write_heartbeat_in(folder, hb(r, t=time.time()))
    pub = Publisher(root, folder, NodeFacts(0, "h0", os.getpid(), 3600.0), TIMEOUTS)
    assert pub.publish()
    s = read_summary(RunDir.of(root).node_summary(0))
    assert [x.rank for x in s.snapshots()] == [0, 1, 2] and s.header.attention == ()
    assert os.listdir(RunDir.of(root).heartbeats) == ["node_00000.json"]  # nothing per rank, no tmp left
    pub.update(verdict="launch 1: done")
    pub.stop()
    assert read_summary(RunDir.of(root).node_summary(0)).header.verdict == "launch 1: done"
    assert not folder.exists() and not folder.parent.exists()


def test_an_unusable_node_folder_falls_back_to_the_run_dir_with_the_reason(tmp_path):
    root = tmp_path / "run"
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / f"supervisor-{os.getuid()}").symlink_to(tmp_path)  # someone else's trap
    folder, msg = choose_folder(tmp_path / "base", root, 0)
    assert folder == RunDir.of(root).heartbeats
    assert "not a directory of this user" in msg and str(folder) in msg
    ok, _ = choose_folder(tmp_path / "shm", root, 0)
    assert ok.is_dir() and (ok.parent.parent.stat().st_mode & 0o777) == 0o700


def test_header_refuses_garbage_with_a_reason():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_header(b"{half")
    with pytest.raises(ValueError, match="'node'"):
        parse_header(b'{"node": "x", "phases": {}, "attention": []}')
    with pytest.raises(ValueError, match="'phases' missing"):
        parse_header(b'{"node": 0}')


def _outcome(parse, d):
    try:
        return parse(d)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("bad", [None, True, "x", 1.5, 3, [], {}, "missing"])
def test_header_fast_path_agrees_with_the_field_by_field_check(bad):
    """parse_header's one-pass check accepts exactly what the field-by-field one does, with the
    same values (a field wrong in any way falls to the slow path and its reason)."""
    header, _, _ = build_summary([], NodeFacts(3, "h0", 55, 5.0, launch_id=LID), Clock(1000.0), TIMEOUTS)
    good = header.to_dict()
    assert list(good) == [f.name for f in dataclasses.fields(SummaryHeader)]
    assert parse_header(json.dumps(good)) == header
    for key in good:
        d = {k: v for k, v in good.items() if k != key} if bad == "missing" else {**good, key: bad}
        assert _outcome(parse_header, json.dumps(d)) == _outcome(_parse_header_slowly, d), key
    for key, bad_list in (("phases", {"train": True}), ("attention", [1, "x"])):
        d = {**good, key: bad_list}
        assert _outcome(parse_header, json.dumps(d)) == _outcome(_parse_header_slowly, d), key


def run_dir(tmp_path: Path, status: str = "running") -> Path:
    root = tmp_path / "run"
    root.mkdir(parents=True)
    write_state(
        root,
        RunState(
            host="elsewhere",
            watchdog_pid=1,
            status=status,
            launch_count=1,
            launch_id=LID,
            timeouts=TIMEOUTS.to_dict(),
        ),
    )
    return root


def publish(root: Path, node: int, beats: list[Heartbeat], at: float, interval: float = 5.0) -> None:
    folder = root.parent / f"n{node}"
    for b in beats:
        write_heartbeat_in(folder, b)
    facts = NodeFacts(node, f"h{node}", 99, interval, launch_id=LID, verdict="launch 1: running")
    header, records, problems = build_summary(read_heartbeat_folder(folder), facts, Clock(at), TIMEOUTS)
    write_summary(root, header, records, problems)


def test_status_reads_summaries_and_rank_files(tmp_path):
    root = run_dir(tmp_path)
    now = time.time()
    publish(root, 0, [hb(0, t=now - 1), hb(1, t=now - 1)], at=now - 1)
    write_heartbeat(root, hb(8, t=now - 1))  # a rank run without a watchdog
    r = build_report(root)
    assert [(x.rank, x.stale) for x in r.ranks] == [(0, False), (1, False), (8, False)]
    assert r.rank_counts.total == 3 and r.rank_counts.complete
    assert r.current_step == 7 and not r.nodes[0].summary_stale and r.nodes[0].ranks == 2
    assert r.nodes[0].verdict == "launch 1: running"


def test_a_stale_summary_marks_its_ranks_and_the_run(tmp_path):
    root = run_dir(tmp_path)
    now = time.time()
    publish(root, 0, [hb(0, t=now - 1)], at=now - 60)  # not rewritten for 60 s > 15 s
    r = build_report(root)
    (row,) = r.ranks
    assert row.stale and "node 0 summary 60s old" in row.note and "watchdog is gone" in row.note
    assert r.nodes[0].summary_stale and "STALE node summary of node 0" in r.why
    assert "STALE 1m" in render(r) or "STALE 60s" in render(r)
    # the watchdog said it ended: its last summary is old by design, not stale
    done = build_report(run_dir(tmp_path / "done", status="done"))
    assert not done.nodes[0].summary_stale


def test_node_n_state_comes_from_its_summary_header(tmp_path):
    """Node 0's state file is read whole; node 1's state (status, launches, restarts) comes from its
    summary's header, so 2,048 state files with their histories are not parsed."""
    root = run_dir(tmp_path)
    write_state(root, RunState(node=1, host="elsewhere", status="running", launch_count=1, launch_id="old"))
    now = time.time()
    write_heartbeat_in(tmp_path / "n1", hb(8, t=now))
    facts = NodeFacts(1, "h1", 99, 5.0, "restarting", "launch 7: crash", None, 7, 6, "", "launch 7: crash")
    write_summary(root, *build_summary(read_heartbeat_folder(tmp_path / "n1"), facts, Clock(now), TIMEOUTS))
    r = build_report(root)
    n1 = next(n for n in r.nodes if n.node == 1)
    assert (n1.status, n1.launches, n1.restarts, n1.verdict) == ("restarting", 7, 6, "launch 7: crash")
    assert (r.state, r.why) == ("restarting", "launch 7: crash (node 1)")


def test_a_garbage_summary_is_named_never_fatal(tmp_path):
    root = run_dir(tmp_path)
    RunDir.of(root).heartbeats.mkdir()
    RunDir.of(root).node_summary(0).write_text('{"node": 0}\n')
    r = build_report(root)
    assert "node summary unusable" in r.nodes[0].problem and "'phases' missing" in r.nodes[0].problem


def test_a_big_run_is_counted_from_headers_and_lists_who_needs_a_look(tmp_path, monkeypatch):
    monkeypatch.setattr("supervisor.report.FULL_RANKS", 8)
    root = run_dir(tmp_path)
    now = time.time()
    for node in range(3):
        beats = [hb(node * 8 + i, step=7 + node, t=now - 1) for i in range(8)]
        if node == 1:
            beats[2] = hb(10, t=now - 30)  # silent
        publish(root, node, beats, at=now - 1)
    r = build_report(root)
    assert [x.rank for x in r.ranks] == [10] and r.ranks[0].stale
    c = r.rank_counts
    assert (c.total, c.phases, c.step_min, c.step_max, c.stale, c.complete) == (
        24,
        (("train", 24),),
        7,
        9,
        1,
        False,
    )
    assert r.current_step == 9
    assert "ranks (24): steps 7..9; 24 train; 1 stale or unknown (listed below)" in render(r)
    full = build_report(root, all_ranks=True)
    assert len(full.ranks) == 24 and full.rank_counts.complete


def test_tools_see_the_freshest_record_of_each_rank(tmp_path):
    root = run_dir(tmp_path)
    now = time.time()
    publish(root, 0, [hb(0, step=5, t=now - 10), hb(1, step=5, t=now - 10)], at=now - 10)
    write_heartbeat(root, hb(1, step=9, t=now))  # newer than the summary's
    assert {s.rank: s.heartbeat.step for s in read_run_heartbeats(root)} == {0: 5, 1: 9}


def test_watchdog_keeps_heartbeats_on_the_node_and_publishes_a_summary(tmp_path):
    """A real watchdog over the fake trainer: no rank file in the run directory, one summary per
    node with every rank and the final verdict; the node-local folder is gone afterwards."""
    root, base = tmp_path / "run", tmp_path / "shm"
    p = start(root, ["--node-dir", str(base), "--summary-interval", "0.2"], ["--ranks", "3", "--steps", "6"])
    rc, out = finish(p)
    assert rc == Exit.OK, out[-3000:]
    names = os.listdir(RunDir.of(root).heartbeats)  # and the ranks' stack dump files
    assert "node_00000.json" in names and not [n for n in names if n.startswith("rank_")]
    s = read_summary(RunDir.of(root).node_summary(0))
    assert [x.heartbeat.phase for x in s.snapshots()] == [Phase.DONE] * 3
    assert s.header.verdict.startswith("launch 1:") and s.header.launch_id == ""
    assert not any(base.rglob("rank_*.json"))
    r = build_report(root)
    assert r.state == "done" and r.rank_counts.total == 3 and not r.nodes[0].summary_stale
